"""Reading dataset artifacts and padding batches. Pure: json + torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str | Path, records) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
            n += 1
    return n


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask), both (B, T) long, T = longest sequence. ``side`` is 'right' or 'left'."""
    assert side in ("right", "left"), side
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(0, len(s)) if side == "right" else slice(T - len(s), T)
        ids[i, sl] = torch.as_tensor(s, dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask


def collate_lm(records: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """SFT / ptx records -> input_ids, attention_mask, labels (-100 on padding)."""
    ids, mask = pad_batch([r["input_ids"] for r in records], pad_id)
    labels, _ = pad_batch([r["labels"] for r in records], -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def collate_pairs(records: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Preference records -> chosen/rejected ids and masks, padded to one length."""
    seqs = [r["chosen_ids"] for r in records] + [r["rejected_ids"] for r in records]
    ids, mask = pad_batch(seqs, pad_id)
    n = len(records)
    return {"chosen_ids": ids[:n], "chosen_mask": mask[:n], "rejected_ids": ids[n:], "rejected_mask": mask[n:]}


def collate_prompts(records: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Prompt records -> left-padded prompt ids and mask, ready for generation."""
    ids, mask = pad_batch([r["prompt_ids"] for r in records], pad_id, side="left")
    return {"input_ids": ids, "attention_mask": mask}
