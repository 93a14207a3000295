"""Chapter 12 — named models, accelerators and published configurations for the planner.

Every number here is a published one, with its source next to it; the planner's formulas live in
``analysis.costmodel``. Three tables:

* :data:`MODELS`: shapes of GPT-2 XL (Radford et al. 2019), GPT-3 (Brown et al. 2020, Table 2.1),
  LLaMA (Touvron et al. 2023, Table 2), Megatron's weak-scaling models (Narayanan et al. 2021,
  Table 1; MT-NLG 530B and "GPT 1T" as aliases) and the course's tiny GPTs;
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

from . import costmodel


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-style decoder (4h MLP, GPT-2 layout) and its training batch.

    ``global_batch`` is in sequences of ``seq`` tokens. ``bias`` / ``tie_embeddings`` as in
    ``models.gpt.GPTConfig``; the duck-typed :meth:`as_cfg` feeds ``costmodel``'s parameter counts.
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

    def __post_init__(self):
        for f in ("layers", "hidden", "heads", "seq", "vocab", "global_batch", "mlp_ratio"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{self.name}: {f} must be a positive int, got {v!r}")
        if self.hidden % self.heads:
            raise ValueError(f"{self.name}: hidden {self.hidden} is not divisible by heads {self.heads}; "
                             f"choose hidden as a multiple of heads")

    def as_cfg(self):
        """The GPTConfig field names ``costmodel.transformer_params`` and friends read."""
        from types import SimpleNamespace

        return SimpleNamespace(n_layer=self.layers, n_embd=self.hidden, n_head=self.heads,
                               vocab_size=self.vocab, block_size=self.seq, mlp_ratio=self.mlp_ratio,
                               bias=self.bias, tie_embeddings=self.tie_embeddings)

    @property
    def params(self) -> int:
        return costmodel.transformer_params(self.as_cfg())

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

#: Named models. GPT-3 shapes from Brown et al. 2020, Table 2.1, with Megatron's vocabulary and
#: the batch in sequences of 2048 (3.2M tokens = 1536 sequences for 175B, the batch of
#: Narayanan et al. 2021 §5.1). GPT-3 XL prints 24 heads of 128 = 3072 != 2048; 16 heads is used.
#: GPT-3 13B prints d_model 5140; 5120 = 40 x 128 is used. LLaMA (Touvron et al. 2023, Table 2):
#: SwiGLU (3 matrices of 2/3 * 4h ~ 8h^2) is modelled as a 4h GELU MLP (the same 8h^2), no biases,
#: untied output layer, 4M-token batches; its 32000-token vocabulary as printed.
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
