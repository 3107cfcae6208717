"""Dev-only: what the fixture scripts share (make_seq2seq.py, make_whisper.py,
make_captioner.py, make_decoder_families.py, make_genai_models.py): the environment pinned
before torch loads, an optimum export whose files are copied into a version folder under the
agent's names, an ONNX file's signature, and a decoder's greedy tokens.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "ENCODER_DECODER_FILES",
    "export_kept",
    "generated",
    "greedy",
    "pin_environment",
    "signature",
]

# What a version folder keeps of optimum's export of an encoder-decoder, renamed: the merged
# decoder is the version's model.onnx; the processor's file with the tokenizer's.
ENCODER_DECODER_FILES = (
    ("encoder_model.onnx", "encoder_model.onnx"),
    ("decoder_model_merged.onnx", "model.onnx"),
    ("config.json", "config.json"),
    ("generation_config.json", "generation_config.json"),
    ("preprocessor_config.json", "preprocessor_config.json"),
    ("tokenizer.json", "tokenizer.json"),
    ("tokenizer_config.json", "tokenizer_config.json"),
    ("special_tokens_map.json", "special_tokens_map.json"),
)


def pin_environment() -> None:
    """No hub; PyTorch's and oneDNN's AVX2 kernels (AVX-512 ones move the logits' last digits,
    and with them the files' bytes). Before torch loads."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("DNNL_MAX_CPU_ISA", "AVX2")


def export_kept(
    save: Callable[[Path], None],
    task: str,
    dst: Path,
    keep: Sequence[tuple[str, str]] = ENCODER_DECODER_FILES,
) -> None:
    """`dst` made anew with the `keep` files (optimum's name, the folder's) of optimum's
    `task` export of what `save` writes (a model, its tokenizer and processor)."""
    from optimum.exporters.onnx import main_export

    with tempfile.TemporaryDirectory(prefix="fixture-export-") as tmp:
        src, onnx_dir = Path(tmp) / "hf", Path(tmp) / "onnx"
        save(src)
        main_export(str(src), output=str(onnx_dir), task=task, device="cpu")
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        for name, kept in keep:
            shutil.copy(onnx_dir / name, dst / kept)


def signature(path: Path) -> dict[str, Any]:
    """The inputs and outputs of the ONNX file `path` as ONNX Runtime reads them."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def described(values: Any) -> list[dict[str, Any]]:
        return [{"name": v.name, "type": v.type, "shape": v.shape} for v in values]

    return {"inputs": described(session.get_inputs()), "outputs": described(session.get_outputs())}


def generated(model: Any, ids: list[int], new_tokens: int, **settings: Any) -> Any:
    """Hugging Face's `generate` of at most `new_tokens` after the prompt `ids` (a mask of
    ones, no sampling unless `settings` say), its output as a dict (`sequences`, and the
    `scores` or `logits` that `settings` ask for)."""
    import torch

    with torch.no_grad():
        return model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=new_tokens,
            return_dict_in_generate=True,
            **settings,
        )


def greedy(model: Any, ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    """A decoder's Hugging Face greedy tokens (`generate(do_sample=False)`) after `ids`, and
    the smallest top-1/top-2 logit gap along the path (a tie would make greedy ill-defined)."""
    out = generated(model, ids, new_tokens, output_scores=True)
    tokens = [int(t) for t in out.sequences[0, len(ids) :]]
    gaps = []
    for scores in out.scores:
        best = scores[0].topk(2).values
        gaps.append(float((best[0] - best[1]).item()))
    return tokens, min(gaps)
