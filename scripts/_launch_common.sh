# Sourced by the MindScale launch scripts: the repository root and the Python that has MindSpore.
# PYTHON overrides the interpreter (default: the repository's .venv, else python3); msrun is taken
# from the same bin folder, and so is the `python` that msrun starts in every worker.
MINDSCALE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${PYTHON:-}" ]]; then
  mindscale_python=$PYTHON
elif [[ -x "$MINDSCALE_ROOT/.venv/bin/python" ]]; then
  mindscale_python="$MINDSCALE_ROOT/.venv/bin/python"
else
  mindscale_python=python3
fi
export PYTHONPATH="$MINDSCALE_ROOT${PYTHONPATH:+:$PYTHONPATH}"

# One line on stderr, exit 2 (bad input), like mindscale.cli.fail.
mindscale_fail() {
  echo "error: $*" >&2
  exit 2
}
