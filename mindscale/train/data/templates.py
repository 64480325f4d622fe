"""Prompt templates for supervised fine-tuning (SFT), kept as data: one `Template` per model family.

A training example is a conversation (system?, user, assistant, user, assistant, ...). A template
says which text surrounds each turn; `encode_examples` turns records into token ids and loss masks
that are 1 only on assistant tokens (the answer and the end-of-turn token), so prompt tokens do not
contribute to the loss. `encode_prompt` renders the same conversation up to the assistant header,
which is what generation must feed to reproduce the training format.

Pieces are either text (a format string with `{content}`) or the Special tokens BOS / EOS, which
become the tokenizer's ids (SentencePiece does not turn the text "<s>" into the BOS id). Each text piece
is tokenized on its own, so SentencePiece's dummy prefix supplies the space at a piece start.
LLaMA-3's `<|begin_of_text|>` and `<|eot_id|>` are special tokens of Meta's tokenizer; with a
SentencePiece tokenizer they map to BOS and EOS, and the header markers are ordinary text unless
the tokenizer defines them (tools/train_tokenizer.py --user-defined-symbols); a Hugging Face
tokenizer folder defines them.

The template `hf` is not data here: it is a Hugging Face tokenizer folder's own chat_template,
rendered by transformers (mindscale/train/data/chat_template.py); it renders into the same (piece,
trained) pairs, so encoding and masking are the same code for every template.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from mindscale.config import UserError


class Special(Enum):
    """A token given by id, not by text; a user's text "<s>" stays text."""

    BOS = "bos"
    EOS = "eos"


BOS, EOS = Special.BOS, Special.EOS
ROLES = ("system", "user", "assistant")


class RecordError(UserError):
    """An SFT record that cannot be turned into a conversation; the message names the field."""

    def __init__(self, message: str, index: int = 0):
        super().__init__(message)
        self.index = index  # position of the bad record in the list given to encode_examples


@dataclass(frozen=True)
class Template:
    name: str
    begin: tuple  # pieces at the start of every example
    system: tuple  # pieces of a system message
    user: tuple  # pieces of a user turn, ending with the assistant header (prompt side)
    assistant: tuple  # pieces of an assistant turn (trained)
    system_in_first_user: bool = False  # LLaMA-2: the system text sits inside the first [INST]
    default_system: str = ""  # used when a record has no system message
    instruction_with_input: str = "{instruction}\n\n{input}"  # Alpaca records with a non-empty input

    def render(self, messages: list[dict], for_generation: bool = False) -> list[tuple]:
        return render(messages, self, for_generation)


TEMPLATES = {
    "alpaca": Template(
        name="alpaca",
        begin=(BOS,),
        system=("{content}\n\n",),
        user=("### Instruction:\n{content}\n\n### Response:\n",),
        assistant=("{content}", EOS),
        default_system="Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.",
        instruction_with_input="{instruction}\n\n### Input:\n{input}",
    ),
    "llama2": Template(
        name="llama2",
        begin=(),
        system=("<<SYS>>\n{content}\n<</SYS>>\n\n",),
        user=(BOS, "[INST] {content} [/INST]"),
        assistant=("{content}", EOS),
        system_in_first_user=True,
    ),
    "llama3": Template(
        name="llama3",
        begin=(BOS,),
        system=("<|start_header_id|>system<|end_header_id|>\n\n{content}", EOS),
        user=(
            "<|start_header_id|>user<|end_header_id|>\n\n{content}",
            EOS,
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        assistant=("{content}", EOS),
    ),
}


HF_TEMPLATE = "hf"  # the tokenizer folder's own chat_template
TEMPLATE_CHOICES = (*sorted(TEMPLATES), HF_TEMPLATE)


def _text(record: dict, key: str) -> str:
    value = record.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RecordError(f"field {key!r} must be a string, got {type(value).__name__}")
    return value


def record_to_messages(record: dict, template) -> list[dict]:
    """An Alpaca record (instruction/input/output) or a chat record (messages) as a message list."""
    if record.get("messages") is not None:
        messages = record["messages"]
        if not isinstance(messages, list):
            raise RecordError("field 'messages' must be a list of {role, content} objects")
        for i, message in enumerate(messages):
            if (
                not isinstance(message, dict)
                or message.get("role") not in ROLES
                or not isinstance(message.get("content"), str)
            ):
                raise RecordError(f"messages[{i}]={message!r}: needs role in {list(ROLES)} and a string content")
        return list(messages)
    if record.get("instruction") is None or record.get("output") is None:
        present = sorted(k for k, v in record.items() if v is not None)
        raise RecordError(
            f"record has fields {present}; an SFT record needs 'messages' or "
            "'instruction' and 'output' (and optionally 'input')"
        )
    instruction, extra = _text(record, "instruction"), _text(record, "input")
    user = template.instruction_with_input.format(instruction=instruction, input=extra) if extra else instruction
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": _text(record, "output")}]
    if _text(record, "system"):
        messages.insert(0, {"role": "system", "content": _text(record, "system")})
    return messages


def _split_system(messages: list[dict], template: Template) -> tuple[str, list[dict]]:
    if messages and messages[0]["role"] == "system":
        return messages[0]["content"], messages[1:]
    return template.default_system, messages


def check_turns(turns: list[dict], for_generation: bool) -> None:
    """user/assistant strictly alternate from a user turn; training ends on an answer, generation on a question."""
    for i, message in enumerate(turns):
        want = "user" if i % 2 == 0 else "assistant"
        if message["role"] != want:
            raise RecordError(
                f"turn {i} has role {message['role']!r}, expected {want!r}: after an optional "
                "system message, user and assistant turns must alternate starting with user"
            )
    last = "user" if for_generation else "assistant"
    if not turns or turns[-1]["role"] != last:
        raise RecordError(
            f"the conversation must end with a {last} turn"
            + ("" if for_generation else " (an example needs an answer to train on)")
        )


def _fill(pieces: tuple, content: str, trained: bool) -> list[tuple]:
    return [(p if isinstance(p, Special) else p.format(content=content), trained) for p in pieces]


def render(messages: list[dict], template: Template, for_generation: bool = False) -> list[tuple]:
    """(piece, trained) pairs for a conversation; a piece is formatted text or a Special token."""
    system, turns = _split_system(messages, template)
    check_turns(turns, for_generation)
    pieces = _fill(template.begin, "", False)
    if system and not template.system_in_first_user:
        pieces += _fill(template.system, system, False)
    for i, message in enumerate(turns):
        content = message["content"]
        if message["role"] == "assistant":
            pieces += _fill(template.assistant, content, True)
            continue
        if i == 0 and system and template.system_in_first_user:
            content = "".join(p for p, _ in _fill(template.system, system, False)) + content
        pieces += _fill(template.user, content, False)
    return pieces


def _encode(rendered: list[list[tuple]], tokenizer, num_threads: int) -> list[tuple[list[int], list[int]]]:
    """Token ids and loss masks of rendered conversations; all text pieces go to the tokenizer in one call."""
    special_ids = {BOS: tokenizer.bos_id, EOS: tokenizer.eos_id}
    texts = [piece for pieces in rendered for piece, _ in pieces if not isinstance(piece, Special)]
    encoded = iter(tokenizer.encode(texts, num_threads=num_threads))
    out = []
    for pieces in rendered:
        ids: list[int] = []
        mask: list[int] = []
        for piece, trained in pieces:
            if isinstance(piece, Special):
                piece_ids = [special_ids[piece]] if special_ids[piece] is not None else []
            else:
                piece_ids = next(encoded)
            ids += piece_ids
            mask += [int(trained)] * len(piece_ids)
        out.append((ids, mask))
    return out


def encode_examples(
    records: list[dict], template, tokenizer, num_threads: int = 1
) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) per SFT record, mask 1 on assistant tokens; `template` is a get_template() (mindscale/train/data/chat_template.py)
    result, `tokenizer` a mindscale.train.data.tokenizers one.

    A bad record raises RecordError with its position in `records` as `.index`.
    """
    rendered = []
    for index, record in enumerate(records):
        try:
            rendered.append(template.render(record_to_messages(record, template)))
        except RecordError as exc:
            raise RecordError(str(exc), index) from None
    return _encode(rendered, tokenizer, num_threads)


def encode_prompt(messages: list[dict], template, tokenizer) -> list[int]:
    """Token ids of a conversation ending with a user turn, up to where the model's answer starts."""
    return _encode([template.render(messages, for_generation=True)], tokenizer, 1)[0][0]
