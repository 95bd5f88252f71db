"""Tokenization of each record shape (prompt/response, chat messages, preference pairs).

Segments are encoded apart so the boundary between prompt and response is exact; chat records go
through the tokenizer's chat template, with labels only on assistant turns, and end at the
template's turn-end token (``end_with_eos``).
"""

from __future__ import annotations

from tasks.common.model import turn_end_id
from tasks.data.config import DataConfig
from tasks.data.formats import DataError


def truncate_left(ids: list[int], n: int, keep: list[int]) -> list[int]:
    """The last ``n`` tokens, keeping a leading special prefix (BOS) when ``ids`` has it."""
    if len(ids) <= n:
        return ids
    if keep and ids[: len(keep)] == keep and n > len(keep):
        return keep + ids[len(ids) - (n - len(keep)):]
    return ids[len(ids) - n:]


class Encoder:
    """Tokenization of each record shape; segments are encoded apart so boundaries are exact."""

    def __init__(self, tok, cfg: DataConfig):
        self.tok, self.cfg, self.eos = tok, cfg, tok.eos_token_id
        if self.eos is None:
            raise DataError("the tokenizer has no eos_token; set model.tokenizer to one that has (responses must end with EOS)")
        with_sp, without = tok("x")["input_ids"], self.enc("x")
        # What the tokenizer puts in front of a text (BOS for llama, nothing for gpt2).
        self.prefix = with_sp[: len(with_sp) - len(without)] if with_sp[len(with_sp) - len(without):] == without else []
        self.turn_end = turn_end_id(tok)  # <|im_end|>, <|eot_id|>, eos itself, or None

    def enc(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def chat(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def end_with_eos(self, ids: list[int]) -> list[int]:
        """A rendered chat sequence, ending where the model stops at inference.

        That is right after the template's turn-end token (``turn_end_id``: ``<|im_end|>``,
        ``<|eot_id|>``, or EOS for templates that end turns with ``eos_token``) — not at
        ``eos_token`` when the two differ. Whitespace the template writes after it
        ("...<|im_end|>\\n") is cut, and no EOS is appended: PPO rollouts stop on the turn end
        (it is one of their stop ids), so a token trained after it would never be generated.
        A sequence ending in neither gets EOS appended.
        """
        ends = {self.eos, self.turn_end} - {None}
        hits = [i for i, t in enumerate(ids) if t in ends]
        if hits and ids[hits[-1] + 1:] and not self.tok.decode(ids[hits[-1] + 1:]).strip():
            ids = ids[: hits[-1] + 1]
        return ids if ids and ids[-1] in ends else ids + [self.eos]

    def prompt_ids(self, prompt: str, verbatim: bool = False) -> list[int]:
        """Verbatim text already holds its role markers (an HH transcript): no template around it."""
        return self.prefix + self.enc(prompt if verbatim else self.cfg.prompt_template.replace("{prompt}", prompt))

    def response_ids(self, response: str, verbatim: bool = False) -> list[int]:
        return self.enc(response if verbatim else self.cfg.response_template.replace("{response}", response)) + [self.eos]

    def prompt_response(self, prompt: str, response: str) -> tuple[list[int], list[int], bool]:
        """(input_ids, labels, truncated): labels -100 on the prompt; an over-long prompt loses its left."""
        p, r, L = self.prompt_ids(prompt), self.response_ids(response), self.cfg.max_length
        truncated = len(p) + len(r) > L
        if truncated and len(r) < L:
            p = truncate_left(p, L - len(r), self.prefix)
        ids = (p + r)[:L]
        return ids, ([-100] * len(p) + r)[:L], truncated

    def messages(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """Chat template; labels only on assistant turns, found by rendering prefixes in turn."""
        ids, labels, prev, last_assistant_end = [], [], "", 0
        for i, m in enumerate(messages):
            steps = [(self.chat(messages[:i], True), False)] if m["role"] == "assistant" and i > 0 else []
            for text, train in steps + [(self.chat(messages[: i + 1]), m["role"] == "assistant")]:
                if not text.startswith(prev):
                    raise DataError("the tokenizer's chat template does not render conversations incrementally "
                                    "(a prefix re-renders differently), so assistant turns cannot be located; "
                                    "use prompt/response records or another model.tokenizer")
                seg = self.enc(text[len(prev):])
                ids += seg
                labels += seg if train else [-100] * len(seg)
                prev = text
            if m["role"] == "assistant":
                last_assistant_end = len(ids)
        # Later user turns have nothing to learn; the sequence ends with the last response's EOS.
        ids = self.end_with_eos(ids[:last_assistant_end])
        labels = labels[: len(ids)] + ids[len(labels):]
        return ids, labels

    def render_prompt(self, record: dict) -> str:
        if "messages" in record:
            return self.chat(record["messages"], True)
        if record.get("verbatim"):
            return record["prompt"]
        return self.cfg.prompt_template.replace("{prompt}", record["prompt"])

    def pair(self, rec: dict) -> tuple[list[int], list[int], list[int]]:
        """(prompt, chosen completion, rejected completion) token ids; completions end with EOS."""
        if "prompt" in rec:
            v = bool(rec.get("verbatim"))
            return self.prompt_ids(rec["prompt"], v), self.response_ids(rec["chosen"], v), self.response_ids(rec["rejected"], v)
        head = self.chat(rec["prompt_messages"], True)
        out = [self.enc(head)]
        for key in ("chosen_messages", "rejected_messages"):
            full = self.chat(rec["prompt_messages"] + rec[key])
            if not full.startswith(head):
                raise DataError("the tokenizer's chat template renders the prompt differently once a response follows; "
                                "use string prompt/chosen/rejected records or another model.tokenizer")
            out.append(self.end_with_eos(self.enc(full[len(head):])))
        return out[0], out[1], out[2]
