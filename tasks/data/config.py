"""Data prep config."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from storage.store import reject_credentials

# Keys that would put secrets into flow parameters and manifests (as store.storage_options refuses).


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # A source is a file, a glob of shards or a folder (also a datasets.save_to_disk folder) of
    # .jsonl .json .csv .tsv .txt .parquet .arrow, optionally .gz/.bz2/.xz/.zst (tasks/data/sources.py).
    sft_path: str | None = Field(None, description="SFT data URI: prompt/response, Alpaca instruction/output, messages, ShareGPT conversations or text records (README: Data). None: the built-in task.")
    preference_path: str | None = Field(None, description="Preference pairs URI: prompt/chosen/rejected, HH-style full transcripts (prompt implicit) or conversational pairs. None: the built-in task.")
    prompts_path: str | None = Field(None, description="PPO prompts URI: prompt, messages, conversations, Alpaca instruction, preference pairs (their prompt), or .txt lines. None: the built-in task.")
    ptx_path: str | None = Field(None, description="Pretraining text URI for the PPO ptx loss (the SFT shapes). None: the built-in task.")
    columns: dict[str, str] = Field(default_factory=dict, description="Rename your fields to ours: {prompt|response|chosen|rejected|messages|text: your_field}, for every source that has that field; '<source>.<name>' (e.g. 'preference.prompt') for one source, required in each of its records.")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec options for the data URIs (not credentials: those come from the environment).")
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Share of each data set held out for evaluation (split by seed).")
    max_length: int = Field(64, gt=8, description="Max tokens of a training sequence (seed: 512).")
    max_prompt_length: int = Field(32, gt=1, description="Max tokens of a PPO prompt (seed pads prompts to 96).")
    short_text: bool = Field(False, description="Plain-text SFT: keep each line its own sample instead of grouping adjacent lines up to max_length (seed --is_short_text).")
    prompt_template: str = Field("Human: {prompt}\nAssistant:", description="How a prompt is rendered (must contain {prompt}); chat `messages` use the tokenizer's chat template instead.")
    response_template: str = Field(" {response}", description="How a response follows the rendered prompt (must contain {response}); EOS is appended.")
    builtin_seed: int = Field(0, description="Seed of the built-in task generator.")
    prompt_metadata: list[str] = Field(default_factory=list, description="Fields of each prompts record (as named in your data) carried to PPO as its metadata, e.g. ['answer']: reward functions and servers (ppo.rewards) get them as keyword lists. Each must be in every prompts record.")

    @field_validator("prompt_template")
    @classmethod
    def _has_prompt(cls, v: str) -> str:
        if "{prompt}" not in v:
            raise ValueError(f"data.prompt_template {v!r} has no {{prompt}} placeholder; write e.g. 'Human: {{prompt}}\\nAssistant:'")
        return v

    @field_validator("response_template")
    @classmethod
    def _has_response(cls, v: str) -> str:
        if "{response}" not in v:
            raise ValueError(f"data.response_template {v!r} has no {{response}} placeholder; write e.g. ' {{response}}'")
        return v

    @field_validator("columns")
    @classmethod
    def _known_columns(cls, v: dict[str, str]) -> dict[str, str]:
        from tasks.data.formats import COLUMNS, KINDS

        for key, col in v.items():
            kind, _, name = key.rpartition(".")
            if name not in COLUMNS or (kind and kind not in KINDS):
                raise ValueError(f"data.columns key {key!r}: expected one of {', '.join(COLUMNS)}, optionally prefixed "
                                 f"by a source ({', '.join(KINDS)}), e.g. 'prompt' or 'preference.prompt'")
            if not col.strip():
                raise ValueError(f"data.columns[{key!r}] is empty; give the name of the field in your data")
        return v

    @field_validator("storage_options")
    @classmethod
    def _no_credentials(cls, v: dict) -> dict:
        return reject_credentials("data.storage_options", v)
