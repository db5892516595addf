"""``ModelConfig``: the model-loading and LoRA/quantization options of TRL's example scripts (``trl.ModelConfig``).

One dataclass serves scripts of both eras: TRL 0.11 names the load dtype ``torch_dtype``, TRL 1.x ``dtype``; both
fields exist and whichever a user sets is copied to the other, so ``model_config.torch_dtype`` (0.11 scripts) and
``model_args.dtype`` (1.x scripts) read the same value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass
class ModelConfig:
    """Model checkpoint, loading options, LoRA adapter and bitsandbytes quantization, as TRL's scripts parse them."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "Model checkpoint (hub id or folder)."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of the checkpoint."})
    torch_dtype: str | None = field(default=None, metadata={
        "help": "Load dtype (TRL 0.11 name of `dtype`).", "choices": DTYPES})
    dtype: str | None = field(default=None, metadata={"help": "Load dtype (TRL 1.x name).", "choices": DTYPES})
    # not an argparse field (init=False): TRL 1.x's trainer configs declare --trust_remote_code, and a second
    # declaration makes HfArgumentParser((..., KTOConfig, ModelConfig)) (TRL 0.11's kto.py) fail; ModelConfig still
    # takes it as a keyword (__init__ below) and TrlParser sets it from the command line (rlhf_core.scripts.parser)
    trust_remote_code: bool = field(default=False, init=False, metadata={
        "help": "Run modelling code shipped with the checkpoint."})
    attn_implementation: str | None = field(default=None, metadata={"help": "Attention kernel (eager, sdpa, ...)."})
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of the full model."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (scaling numerator)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": "Modules that get an adapter."})
    lora_target_parameters: list[str] | None = field(default=None, metadata={
        "help": "Parameters that get an adapter (peft's target_parameters)."})
    lora_modules_to_save: list[str] | None = field(default=None, metadata={"help": "Modules trained in full."})
    lora_task_type: str = field(default="CAUSAL_LM", metadata={"help": "peft task type (SEQ_CLS for reward models)."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA: scale alpha/sqrt(r)."})
    use_dora: bool = field(default=False, metadata={"help": "Weight-decomposed LoRA (DoRA)."})
    load_in_8bit: bool = field(default=False, metadata={"help": "Load the base model in 8 bit (needs bitsandbytes)."})
    load_in_4bit: bool = field(default=False, metadata={"help": "Load the base model in 4 bit (needs bitsandbytes)."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "4-bit type.", "choices": ["fp4", "nf4"]})
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "Nested (double) 4-bit quantization."})
    bnb_4bit_quant_storage: str | None = field(default=None, metadata={"help": "Storage dtype of 4-bit weights."})

    def __post_init__(self) -> None:
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("ModelConfig: load_in_8bit and load_in_4bit are exclusive; set one of them")
        if self.torch_dtype is not None and self.dtype is not None and self.torch_dtype != self.dtype:
            raise ValueError(f"ModelConfig: torch_dtype={self.torch_dtype!r} and dtype={self.dtype!r} disagree; "
                             "they are one option (TRL 0.11 and 1.x names), set one")
        for name in ("torch_dtype", "dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                raise ValueError(f"ModelConfig.{name}={value!r}: expected one of {DTYPES}")
        self.torch_dtype = self.dtype = self.torch_dtype or self.dtype
        # TRL unwraps a one-element list (peft then matches that module name as a regex, not a list entry)
        if isinstance(self.lora_target_modules, list) and len(self.lora_target_modules) == 1:
            self.lora_target_modules = self.lora_target_modules[0]


_dataclass_init = ModelConfig.__init__


def _init_with_trust_remote_code(self: ModelConfig, *args, trust_remote_code: bool = False, **kwargs) -> None:
    _dataclass_init(self, *args, **kwargs)
    self.trust_remote_code = trust_remote_code


ModelConfig.__init__ = _init_with_trust_remote_code  # ModelConfig(trust_remote_code=True) as in TRL 0.11
