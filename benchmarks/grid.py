"""The shape grid of ``benchmarks/flce.py --grid``: the head shapes people train, kept as data.

Each point is the output head of a released model family (hidden size H, vocabulary V, the final
softcap where the model has one) at a token count N per step from 2k to 32k. ``amp`` points
hold the weight and hidden states in fp32 under ``torch.autocast(bf16)``, which is what the HF
Trainer's ``bf16=True`` does with an fp32 model; the others are bf16 throughout. Inputs follow
a trained model: logits with a standard deviation of about 3 (``GRID_INPUTS``); each point runs
with 20 % of the labels ignored and with none (``GRID_IGNORE_FRACS``, the row's ``ignore_frac``).
"""

from __future__ import annotations

from dataclasses import dataclass

GRID_INPUTS = dict(logit_std=3.0, ignore_frac=0.2)
# Every point is run at each of these shares of ignored labels: 20 % (fine-tuning with prompts
# masked) and none (packed pretraining, where nothing can be skipped).
GRID_IGNORE_FRACS = (0.2, 0.0)


@dataclass(frozen=True)
class GridPoint:
    model: str
    n: int
    h: int
    v: int
    softcap: float | None = None
    amp: bool = False

    @property
    def name(self) -> str:
        tags = ("_softcap" if self.softcap else "") + ("_amp" if self.amp else "")
        return f"{self.n}x{self.h}x{self.v}{tags}"


def _points(model: str, h: int, v: int, ns: tuple[int, ...], **kw) -> list[GridPoint]:
    return [GridPoint(model, n, h, v, **kw) for n in ns]


GRID: tuple[GridPoint, ...] = tuple(
    _points("Llama-2-7B", 4096, 32000, (4096, 16384))
    + _points("SmolLM2-1.7B", 2048, 49152, (4096, 16384))
    + _points("Llama-3.2-1B", 2048, 128256, (2048, 8192, 32768))
    + _points("Llama-3.2-3B", 3072, 128256, (4096, 16384))
    + _points("Llama-3.1-8B", 4096, 128256, (8192, 16384, 32768))
    + _points("Llama-3.1-70B", 8192, 128256, (2048, 8192))
    + _points("Qwen2.5-0.5B", 896, 151936, (2048, 8192, 32768))
    + _points("Qwen2.5-1.5B", 1536, 151936, (4096, 16384))
    + _points("Qwen2.5-7B", 3584, 152064, (8192, 32768))
    + _points("gpt-oss-20b", 2880, 201088, (4096, 16384))
    + _points("Gemma-3-1B", 1152, 262144, (4096, 16384))
    + _points("Gemma-3-4B", 2560, 262144, (4096, 16384))
    + _points("Gemma-2-2B", 2304, 256000, (8192, 16384), softcap=30.0)
    + _points("Gemma-2-9B", 3584, 256000, (4096,), softcap=30.0)
    + _points("Llama-3.2-1B", 2048, 128256, (8192,), amp=True)
    + _points("Qwen2.5-0.5B", 896, 151936, (8192,), amp=True)
    + _points("Qwen2.5-7B", 3584, 152064, (8192,), amp=True)
    + _points("Gemma-2-2B", 2304, 256000, (8192,), softcap=30.0, amp=True)
)
