"""`--template hf`: a Hugging Face tokenizer folder's own `chat_template`, rendered by transformers
(`PreTrainedTokenizerFast.apply_chat_template`, the folder loaded with `from_pretrained`, so
chat_template.jinja and named templates are found as transformers finds them). No Jinja here.

The loss mask must cover exactly the assistant's tokens, but a template renders a conversation
as one string. It is split at each assistant turn k by rendering two prefixes of the
conversation: `before` = turns < k with the generation prompt (what generation feeds the model
before its answer), and `through` = turns <= k. When `before` is a prefix of `through` and both
are prefixes of the whole rendering, the text between them is turn k's answer as the template
writes it (content and end-of-turn marker), and the text up to `before` is the prompt. A template
that rewrites earlier turns when later ones follow (some drop earlier reasoning) breaks this and
is refused, naming the problem, as is one whose answer text does not contain the answer.

The pieces are then encoded one by one, like the built-in templates' pieces: where a token of
the whole string would straddle a prompt/answer boundary (a template that ends the generation
prompt with a space, say), the split keeps the mask exact and the prompt's tokens identical to
what generation feeds. Elsewhere (the usual case: special tokens or newlines at the boundaries)
the ids equal `apply_chat_template(..., tokenize=True)`.

`get_template` picks a template by name, built-in or `hf`; it lives here, above both kinds.
"""

from __future__ import annotations

from mindscale.train.data.templates import HF_TEMPLATE, TEMPLATE_CHOICES, TEMPLATES, RecordError, check_turns

NO_TEMPLATE_FIX = "add a chat_template to its tokenizer_config.json or use --template alpaca, llama2 or llama3"


class ChatTemplate:
    """The chat_template of one Hugging Face tokenizer folder, rendering into (text, trained) pieces."""

    name = HF_TEMPLATE
    instruction_with_input = "{instruction}\n\n{input}"  # how Alpaca records become a user turn

    def __init__(self, folder):
        from transformers import PreTrainedTokenizerFast

        self.folder = folder
        self.hf = PreTrainedTokenizerFast.from_pretrained(str(folder))
        if not self.hf.chat_template:
            raise RecordError(f"--template hf: the tokenizer folder {folder} has no chat_template; {NO_TEMPLATE_FIX}")

    @classmethod
    def of(cls, tokenizer) -> "ChatTemplate":
        """The chat template of `tokenizer`'s folder (a SentencePiece model has none)."""
        if tokenizer is None or tokenizer.folder is None:
            where = f"the SentencePiece model {tokenizer.path}" if tokenizer is not None else "no tokenizer"
            raise RecordError(
                f"--template hf needs a Hugging Face tokenizer folder (tokenizer.json with a "
                f"chat_template), got {where}; point --tokenizer / data.tokenizer at such a folder "
                "or use --template alpaca, llama2 or llama3"
            )
        return cls(tokenizer.folder)

    def text(self, messages: list[dict], generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except TemplateError as exc:  # the template's own raise_exception(...) lands here too
            raise RecordError(f"the chat_template of {self.folder} refused the conversation: {exc}") from None

    def render(self, messages: list[dict], for_generation: bool = False) -> list[tuple[str, bool]]:
        """(text, trained) pieces; trained pieces are the assistant turns as the template writes them."""
        turns = messages[1:] if messages and messages[0]["role"] == "system" else messages
        check_turns(turns, for_generation)
        if for_generation:
            return [(self.text(messages, True), False)]
        whole = self.text(messages, False)
        pieces, done = [], 0
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = self.text(messages[:k], True), self.text(messages[: k + 1], False)
            if not (whole.startswith(through) and through.startswith(before) and len(before) >= done):
                raise RecordError(
                    f"the chat_template of {self.folder} cannot be split at assistant turn {k}: "
                    "the conversation rendered up to it is not the start of the whole rendering "
                    "(the template rewrites earlier turns), so the answer's tokens cannot be "
                    "masked exactly; use --template alpaca, llama2 or llama3"
                )
            answer = whole[len(before) : len(through)]
            if not self._answer_only(answer, message["content"], before, messages[:k]):
                raise RecordError(
                    f"the chat_template of {self.folder} does not render assistant turn {k} as its "
                    "content after the generation prompt (add_generation_prompt), so the answer's "
                    "tokens cannot be masked exactly; use --template alpaca, llama2 or llama3"
                )
            pieces += [(whole[done : len(before)], False), (answer, True)]
            done = len(through)
        return pieces + [(whole[done:], False)]

    def _answer_only(self, answer: str, content: str, before: str, earlier: list[dict]) -> bool:
        """The trained text holds the answer, and no assistant header: a template whose generation prompt
        is empty must put the answer first (the header, if any, then came with the user turn)."""
        if content.strip() not in answer:
            return False
        return answer.lstrip().startswith(content.strip()) or before != self.text(earlier, False)


def get_template(name: str, tokenizer=None):
    """The template called `name`; `hf` needs the tokenizer (mindscale/train/data/tokenizers.py) whose
    folder holds the chat_template."""
    if name == HF_TEMPLATE:
        return ChatTemplate.of(tokenizer)
    if name not in TEMPLATES:
        raise RecordError(f"unknown template {name!r}; use one of {list(TEMPLATE_CHOICES)}")
    return TEMPLATES[name]
