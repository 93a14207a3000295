"""Chapter 12 — named models, accelerators and published configurations for the planner.

Every number here is a published one, with its source next to it; the planner's formulas live in
``costmodel``. Three tables:

* :data:`MODELS`: shapes of GPT-2 XL (Radford et al. 2019), GPT-3 (Brown et al. 2020, Table 2.1),
  LLaMA (Touvron et al. 2023, Table 2), Llama 3 (Dubey et al. 2024, Table 3: grouped-query
  attention and SwiGLU, counted by ``costmodel.llama``), Megatron's weak-scaling models (Narayanan
  et al. 2021, Table 1; MT-NLG 530B and "GPT 1T" as aliases) and the course's tiny GPTs;
* :data:`GPUS`: memory and dense bf16 peak from ``costmodel.DEVICES`` (the vendor datasheets), and
  each GPU's two links (NVLink inside a node, InfiniBand between nodes) for reference; the
  planner's memory capacity comes from here, every rate it times with from the GPU's machine
  profile (``analysis/profiles``, each number cited);
* :data:`NARAYANAN_TABLE1` and :data:`PUBLISHED`: configurations Megatron-LM reported, to set the
  planner's choices next to.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .. import costmodel
from ..costmodel import llama as llama_cost


@dataclass(frozen=True)
class ModelSpec:
    """A decoder and its training batch: GPT-shaped (a ``mlp_ratio``·h GELU MLP, GPT-2 layout), or
    Llama-shaped when ``ffn_hidden`` is given (SwiGLU of width ``ffn_hidden``, ``kv_heads`` key/value
    heads, RMSNorm, RoPE, no biases: ``models.llama``).

    ``global_batch`` is in sequences of ``seq`` tokens. ``bias`` / ``tie_embeddings`` as in
    ``models.gpt.GPTConfig``; the duck-typed :meth:`as_cfg` feeds ``costmodel``'s parameter counts.
    The shape's own formulas (GPT's or ``costmodel.llama``'s) are behind :meth:`stage_params`,
    :meth:`activation_bytes`, :meth:`microbatch_seconds`, :meth:`flops_per_step` and
    :meth:`flops_per_token`, which the planner calls.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    global_batch: int
    mlp_ratio: int = 4
    bias: bool = True
    tie_embeddings: bool = True
    source: str = ""
    aliases: tuple = ()  #: other names :func:`get_model` accepts for this model
    kv_heads: int | None = None  #: key/value heads (grouped-query attention; Llama-shaped only)
    ffn_hidden: int | None = None  #: SwiGLU width: given, the model is Llama-shaped

    def __post_init__(self):
        for f in ("layers", "hidden", "heads", "seq", "vocab", "global_batch", "mlp_ratio"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{self.name}: {f} must be a positive int, got {v!r}")
        if self.hidden % self.heads:
            raise ValueError(f"{self.name}: hidden {self.hidden} is not divisible by heads {self.heads}; "
                             f"choose hidden as a multiple of heads")
        if self.kv_heads is not None and (self.ffn_hidden is None or self.heads % self.kv_heads):
            raise ValueError(f"{self.name}: kv_heads {self.kv_heads} needs a Llama-shaped model (give "
                             f"ffn_hidden) and must divide heads {self.heads}")

    @property
    def is_llama(self) -> bool:
        return self.ffn_hidden is not None

    @property
    def n_kv(self) -> int:
        """Key/value heads: ``kv_heads``, or ``heads`` (multi-head attention)."""
        return self.kv_heads or self.heads

    @property
    def ffn_width(self) -> int:
        """The MLP's hidden width: ``ffn_hidden`` (Llama) or ``mlp_ratio * hidden`` (GPT)."""
        return self.ffn_hidden if self.is_llama else self.mlp_ratio * self.hidden

    def as_cfg(self):
        """The GPTConfig field names ``costmodel.transformer_params`` and friends read (and, Llama-shaped,
        the LlamaConfig ones ``costmodel.llama`` reads)."""
        from types import SimpleNamespace

        extra = dict(n_kv_head=self.n_kv, ffn_hidden=self.ffn_hidden) if self.is_llama else {}
        return SimpleNamespace(n_layer=self.layers, n_embd=self.hidden, n_head=self.heads,
                               vocab_size=self.vocab, block_size=self.seq, mlp_ratio=self.mlp_ratio,
                               bias=self.bias, tie_embeddings=self.tie_embeddings, **extra)

    def llama_config(self, **overrides):
        """The ``models.llama.LlamaConfig`` of a Llama-shaped spec (build it on ``meta`` to count it)."""
        from ..models.llama import LlamaConfig

        if not self.is_llama:
            raise ValueError(f"{self.name} is GPT-shaped: build it with models.gpt.GPTConfig")
        return LlamaConfig(**{**dict(vocab_size=self.vocab, block_size=self.seq, n_layer=self.layers,
                                     n_head=self.heads, n_kv_head=self.n_kv,
                                     n_embd=self.hidden, ffn_hidden=self.ffn_hidden,
                                     tie_embeddings=self.tie_embeddings), **overrides})

    @property
    def params(self) -> int:
        if self.is_llama:
            return llama_cost.llama_params(self.as_cfg())
        return costmodel.transformer_params(self.as_cfg())

    # --- the formulas of this shape, as the planner uses them ----------------------------------------
    def stage_params(self, tp: int = 1, pp: int = 1) -> list[int]:
        """Parameters one rank of each pipeline stage holds (``costmodel.pipeline_stage_params``)."""
        if self.is_llama:
            return llama_cost.llama_stage_params(self.as_cfg(), tp, pp)
        return costmodel.pipeline_stage_params(self.as_cfg(), tp, pp)

    def activation_bytes(self, micro_batch, tp, pp, microbatches, sequence_parallel, recompute,
                         schedule="1f1b", v=1) -> float:
        """16-bit activation bytes of the first stage (``costmodel.pipeline_activation_bytes``: the
        stashed microbatches, plus one layer's working set with full recomputation)."""
        if not self.is_llama:
            return costmodel.pipeline_activation_bytes(self.seq, micro_batch, self.hidden, self.heads,
                                                       self.layers, tp, pp, microbatches, sequence_parallel,
                                                       recompute, schedule, v)
        shape = (self.seq, micro_batch, self.hidden, self.heads, self.n_kv, self.ffn_hidden)
        per_stage = llama_cost.llama_activation_bytes(*shape, self.layers // pp, tp, sequence_parallel,
                                                      recompute)
        peak = costmodel.pipeline_stashed_microbatches(schedule, pp, microbatches, stage=0, v=v) * per_stage
        if recompute == "full":
            peak += llama_cost.llama_activation_bytes(*shape, 1, tp, sequence_parallel, "none")
        return peak

    def microbatch_seconds(self, profile, b, layers, tp, precision, recompute, sequence_parallel) -> dict:
        """One microbatch through ``layers`` layers and the LM head (``costmodel.microbatch_seconds``)."""
        if self.is_llama:
            shape = (self.hidden, self.heads, self.n_kv, self.ffn_hidden, self.vocab)
            return llama_cost.llama_microbatch_seconds(profile, b, self.seq, *shape, layers, tp, precision,
                                                       recompute, sequence_parallel)
        return costmodel.microbatch_seconds(profile, b, self.seq, self.hidden, self.heads, self.vocab, layers,
                                            tp, precision, recompute, sequence_parallel, lm_head=True,
                                            mlp_ratio=self.mlp_ratio)

    def kv_replica_elements(self, tp: int) -> int:
        """Per layer and backward: the k, v weight-gradient elements all-reduced over the TP group when
        tp exceeds the kv heads (``costmodel.llama.llama_kv_replica_allreduce_elements``); 0 otherwise."""
        return llama_cost.llama_kv_replica_allreduce_elements(self.as_cfg(), tp) if self.is_llama else 0

    def flops_per_step(self, recompute: str = "none") -> float:
        """FLOPs executed in one step of the global batch, recomputation included."""
        if self.is_llama:
            return llama_cost.llama_flops_per_step(self.as_cfg(), self.global_batch, self.seq, recompute)
        extra = costmodel.recompute_overhead(recompute, self.seq, self.hidden, self.layers, self.vocab)
        return costmodel.megatron_flops_per_step(self.global_batch, self.seq, self.layers, self.hidden,
                                                 self.vocab) * (1 + extra)

    def flops_per_token(self) -> float:
        """Model FLOPs per token of a training step (no recomputation): MFU's numerator."""
        if self.is_llama:
            return llama_cost.llama_flops_per_token(self.as_cfg(), self.seq)
        return costmodel.model_flops_per_token(self.as_cfg(), self.seq)

    @classmethod
    def from_gpt_config(cls, cfg, global_batch: int, seq: int | None = None, name: str = "gpt") -> ModelSpec:
        """The spec of a ``models.gpt.GPTConfig`` trained on ``global_batch`` sequences of ``seq``
        (default ``cfg.block_size``) tokens."""
        return cls(name, cfg.n_layer, cfg.n_embd, cfg.n_head, seq or cfg.block_size, cfg.vocab_size,
                   global_batch, cfg.mlp_ratio, cfg.bias, cfg.tie_embeddings, "models.gpt.GPTConfig")


class GPUSpec(NamedTuple):
    """One accelerator as the planner sees it: capacity, dense peak, and its two links as
    (alpha seconds, beta seconds/byte), beta = 1 / per-direction bandwidth *per GPU*."""

    name: str
    memory_bytes: float
    peak_flops: float
    intra_node: tuple  #: (alpha, beta) of NVLink (tensor parallelism, in-node groups)
    inter_node: tuple  #: (alpha, beta) of the network, one NIC per GPU
    source: str


def _gpu(device, nvlink, network, source):
    spec = costmodel.device_spec(device)
    return GPUSpec(spec.name, spec.memory_bytes, spec.peak_flops["bf16"], nvlink, network, source)


_NVLINK4 = costmodel.LINKS["NVLink 4 (H100 SXM, in a node)"]
_NDR = costmodel.LINKS["InfiniBand NDR 400 Gb/s"]

#: Accelerators. Memory and dense bf16 peak: ``costmodel.DEVICES`` (datasheets). Links: per
#: direction, per GPU. Latencies are a typical order of magnitude (a few microseconds), as in
#: ``costmodel.LINKS``, not measurements.
GPUS = {
    # DGX H100: 8 H100 SXM on NVLink 4 (900 GB/s in both directions together, 450 per direction)
    # and 8 ConnectX-7 NICs, one 400 Gb/s InfiniBand NDR port (50 GB/s) per GPU (DGX H100 user guide).
    "h100": _gpu("h100", _NVLINK4, _NDR,
                 "H100 SXM datasheet; DGX H100: NVLink 4 450 GB/s/direction, NDR 400 Gb/s per GPU"),
    # DGX A100 (the Selene nodes of Narayanan et al. 2021, §5): NVLink 3 through NVSwitch, 600 GB/s in
    # both directions together (300 per direction), and 8 ConnectX-6 HDR InfiniBand ports, 200 Gb/s
    # (25 GB/s) per GPU (A100 datasheet; DGX A100 user guide; Narayanan §5 describes these nodes:
    # eight 80-GB A100s on NVLink/NVSwitch and eight 200 Gb/s HDR InfiniBand HCAs).
    "a100": _gpu("a100", (2e-6, 1 / 300e9), (5e-6, 1 / 25e9),
                 "A100 SXM 80GB datasheet; DGX A100: NVLink 3 300 GB/s/direction, HDR 200 Gb/s per GPU"),
    # The course's CPU ranks (gloo over loopback TCP on one machine). An order of magnitude only:
    # measure your own with costmodel.fit_alpha_beta and GPUSpec._replace(...).
    "cpu": GPUSpec("CPU rank (gloo, one core)", 4e9, 20e9, (50e-6, 1 / 1e9), (50e-6, 1 / 1e9),
                   "order of magnitude for one CPU core and loopback TCP; fit your own"),
}

_NARAYANAN = "Narayanan et al. 2021, Table 1"
_MEGATRON_VOCAB = 51200  # GPT-2's 50,257 BPE tokens padded by Megatron-LM (Narayanan et al. 2021, §5.1)
_LLAMA3 = "Dubey et al. 2024, Table 3"
_LLAMA3_VOCAB = 128256  # Table 3 prints 128,000; the released embedding has 128,256 rows

#: Named models. GPT-3 shapes from Brown et al. 2020, Table 2.1, with Megatron's vocabulary and
#: the batch in sequences of 2048 (3.2M tokens = 1536 sequences for 175B, the batch of
#: Narayanan et al. 2021 §5.1). GPT-3 XL prints 24 heads of 128 = 3072 != 2048; 16 heads is used.
#: GPT-3 13B prints d_model 5140; 5120 = 40 x 128 is used. LLaMA (Touvron et al. 2023, Table 2):
#: SwiGLU (3 matrices of 2/3 * 4h ~ 8h^2) is modelled as a 4h GELU MLP (the same 8h^2), no biases,
#: untied output layer, 4M-token batches; its 32000-token vocabulary as printed. Llama 3 (Dubey et al.
#: 2024, Table 3) is Llama-shaped: 8 kv heads and its FFN width as printed; Table 3 prints a 128,000-token
#: vocabulary, the released weights have 128,256 rows (256 reserved special tokens), used here; the
#: batch is 16M tokens, 2048 sequences of 8192, the 405B's pre-training batch at 8K context (Table 4),
#: applied to 8B and 70B too (their batches are not printed).
MODELS = {m.name: m for m in (
    ModelSpec("gpt2-1.5b", 48, 1600, 25, 1024, _MEGATRON_VOCAB, 512,
              source="Radford et al. 2019, Table 2 (GPT-2 XL, 1542M; 25 heads of 64); batch 512 as printed"),
    ModelSpec("gpt3-1.3b", 24, 2048, 16, 2048, _MEGATRON_VOCAB, 512,
              source="Brown et al. 2020, Table 2.1 (GPT-3 XL)"),
    ModelSpec("gpt3-13b", 40, 5120, 40, 2048, _MEGATRON_VOCAB, 1024, source="Brown et al. 2020, Table 2.1"),
    ModelSpec("gpt3-175b", 96, 12288, 96, 2048, _MEGATRON_VOCAB, 1536,
              source="Brown et al. 2020, Table 2.1; batch 1536 as Narayanan et al. 2021, §5.1"),
    ModelSpec("llama-7b", 32, 4096, 32, 2048, 32000, 2048, bias=False, tie_embeddings=False,
              source="Touvron et al. 2023, Table 2 (SwiGLU as a 4h MLP)"),
    ModelSpec("llama-65b", 80, 8192, 64, 2048, 32000, 2048, bias=False, tie_embeddings=False,
              source="Touvron et al. 2023, Table 2 (SwiGLU as a 4h MLP)"),
    ModelSpec("llama3-8b", 32, 4096, 32, 8192, _LLAMA3_VOCAB, 2048, bias=False, tie_embeddings=False,
              kv_heads=8, ffn_hidden=14336, source=_LLAMA3 + " (8B: 8.0B parameters)"),
    ModelSpec("llama3-70b", 80, 8192, 64, 8192, _LLAMA3_VOCAB, 2048, bias=False, tie_embeddings=False,
              kv_heads=8, ffn_hidden=28672, source=_LLAMA3 + " (70B: 70.6B parameters)"),
    ModelSpec("llama3-405b", 126, 16384, 128, 8192, _LLAMA3_VOCAB, 2048, bias=False, tie_embeddings=False,
              kv_heads=8, ffn_hidden=53248, source=_LLAMA3 + " (405B: 405.9B parameters)"),
    ModelSpec("megatron-145b", 80, 12288, 96, 2048, _MEGATRON_VOCAB, 2304,
              source=_NARAYANAN + " (145.6B row)"),
    # Megatron-Turing NLG 530B (Smith et al. 2022: 105 layers, hidden 20480, 128 heads) is this row
    ModelSpec("megatron-530b", 105, 20480, 128, 2048, _MEGATRON_VOCAB, 2520,
              source=_NARAYANAN + " (529.6B row)", aliases=("mt-nlg-530b",)),
    ModelSpec("megatron-1t", 128, 25600, 160, 2048, _MEGATRON_VOCAB, 3072,
              source=_NARAYANAN + " (1008.0B row)", aliases=("gpt-1t",)),
    # the course's own: GPTConfig.tiny(), GPTConfig.small(), and chapter 12's 3D test model
    ModelSpec("tiny", 2, 64, 4, 64, 64, 8, source="models.gpt.GPTConfig.tiny()"),
    ModelSpec("small", 4, 256, 8, 128, 256, 16, source="models.gpt.GPTConfig.small()"),
    ModelSpec("tiny-3d", 4, 32, 4, 16, 64, 8, source="chapter 12's 2x2x2 test model"),
)}


class Table1Row(NamedTuple):
    """One row of Narayanan et al. 2021, Table 1 (weak scaling on Selene's A100s, seq 2048,
    vocab 51200; "achieved teraFLOP/s per GPU" counts the FLOPs of eq. 3, i.e. *with* activation
    recomputation, so it is hardware FLOP/s, not model FLOP/s)."""

    params_billion: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float
    percent_of_peak: int
    aggregate_pflops: float


#: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
#: Megatron-LM" (SC'21), Table 1, every row as printed.
NARAYANAN_TABLE1 = (
    Table1Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4),
    Table1Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8),
    Table1Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2),
    Table1Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6),
    Table1Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8),
    Table1Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8),
    Table1Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1),
    Table1Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4),
    Table1Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2),
    Table1Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0),
)


def table1_model(row: Table1Row) -> ModelSpec:
    """The :class:`ModelSpec` of a Table 1 row (seq 2048, vocab 51200, batch as printed)."""
    return ModelSpec(f"megatron-{row.params_billion:g}b", row.layers, row.hidden, row.heads, 2048,
                     _MEGATRON_VOCAB, row.batch, source=_NARAYANAN)


class Published(NamedTuple):
    """A configuration a paper or a reference script ran, to compare the planner's choice with."""

    model: str
    gpu: str
    gpus: int
    tp: int
    pp: int
    micro_batch: int
    zero: int
    recompute: str
    tflops_per_gpu: float | None  #: reported hardware FLOP/s per GPU (eq. 3 counting), if any
    source: str


#: GPT-3 175B on 1024 A100s: Megatron-LM's reference script ``examples/pretrain_gpt3_175B.sh``
#: (128 nodes x 8 GPUs; --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
#: --micro-batch-size 1 --global-batch-size 1536 --checkpoint-activations --fp16) and the paper's
#: throughput for this model on 1024 A100s with batch 1536, 140 teraFLOP/s per GPU, 44.9% of the
#: 312 peak (Narayanan et al. 2021, §5.1, the 34-day training-time estimate). Table 1 has no 175B
#: row; its 1T row is the second entry.
PUBLISHED = {
    "gpt3-175b": Published("gpt3-175b", "a100", 1024, 8, 16, 1, 0, "full", 140.0,
                           "Megatron-LM examples/pretrain_gpt3_175B.sh; "
                           "Narayanan et al. 2021, §5.1 (140 TFLOP/s)"),
    "megatron-1t": Published("megatron-1t", "a100", 3072, 8, 64, 1, 0, "full", 163.0,
                             _NARAYANAN + " (1008.0B row; micro-batch size not printed, 1 assumed)"),
}


def _lookup(table: dict, name, what: str):
    if not isinstance(name, str):
        return name
    key = name.lower()
    if key not in table:
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(sorted(table))}")
    return table[key]


def get_model(name) -> ModelSpec:
    """A :class:`ModelSpec` by name or alias (or the spec itself); unknown names list the valid ones."""
    return _lookup({**{a: m for m in MODELS.values() for a in m.aliases}, **MODELS}, name, "model")


def get_gpu(name) -> GPUSpec:
    """A :class:`GPUSpec` by name (or the spec itself); unknown names list the valid ones."""
    return _lookup(GPUS, name, "gpu")
