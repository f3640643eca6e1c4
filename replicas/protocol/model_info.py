"""What the router knows of a served model without loading it: its limits and its tokenizer
as the files ``save_pretrained`` writes. The replica side builds it from the model's own source
(``replicas/model_info.py``: the engine's numbers, chat template and special tokens); the
router counts prompts with it (``router/api/prompt_tokenizer.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ModelInfo:
    served_model_name: str
    max_model_len: int  # longest prompt + output the engine accepts
    kv_capacity_tokens: int  # tokens one replica's whole KV cache holds
    tokenizer_files: dict[str, bytes] = field(repr=False)  # file name -> contents
    created_s: int = 0  # for /v1/models
    adapters: tuple[str, ...] = ()  # the LoRA adapters the settings name (engine.lora_adapters)
    chat_template: str | None = None  # engine.chat_template's text: instead of the model's own
    tool_call_parser: str = "auto"  # engine.tool_call_parser (router/api/tools.py)
