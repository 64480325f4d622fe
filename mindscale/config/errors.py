"""The errors every MindScale command line turns into one line on stderr and exit status 2."""


class UserError(ValueError):
    """Bad input from the user: a config, a file, an argument. The message is one line naming the
    problem and the fix; the command lines print it and exit 2 (mindscale.cli.fail)."""


class ConfigError(UserError):
    """Bad configuration. The message is one line: the key, the value, the fix."""
