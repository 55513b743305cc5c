"""Load a Hugging Face model directory into `pd.model.llama.CausalLM`.

Reads `config.json` and the weights (`model.safetensors`, or shards listed in
`model.safetensors.index.json`). A missing tensor or a tensor of the wrong shape is an error
naming it, and so is a tensor the model has no place for (an MTP layer the config does not
declare, a bias the config does not ask for): nothing is skipped silently. Block-quantized fp8
weights (`*.weight` in float8_e4m3fn with `*.weight_scale_inv`) are dequantized at load.
Tokenizer files are `pd.text.tokenizer`'s business.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from pd.config import ModelConfig, ModelConfigError
from pd.model.llama import CausalLM

log = logging.getLogger(__name__)


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"shard(s) listed in {index.name} are missing: {', '.join(missing)}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise FileNotFoundError(f"no *.safetensors weights in model directory {path}")


# tensors a checkpoint may carry that hold nothing the model computes with
_IGNORABLE = (".rotary_emb.inv_freq",)


def _dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                    name: str) -> torch.Tensor:
    """Block-quantized fp8 [out, in] with per-block scales [ceil(out/b0), ceil(in/b1)] ->
    float32, weight * scale of its block (the scale tensors are named `*_scale_inv`)."""
    rows, cols = weight.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ModelConfigError(f"tensor {name}_scale_inv has shape {tuple(scale_inv.shape)}; "
                         f"{name} {tuple(weight.shape)} in {block[0]}x{block[1]} blocks needs {want}")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def load_model(path: str | Path, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    """Every tensor of the checkpoint is used or refused: an unknown one is an error naming it
    (a feature pd lacks would otherwise be dropped silently), except RoPE tables some
    checkpoints carry and a tied LM head equal to the embeddings."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unused: list[str] = []
    tied_head: torch.Tensor | None = None
    scales: dict[str, torch.Tensor] = {}
    fp8: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for file in weight_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith("_scale_inv") and cfg.fp8_block is not None:
                        scales[name.removesuffix("_scale_inv")] = f.get_tensor(name)
                        continue
                    param = params.get(name)
                    if param is None:
                        if name == "lm_head.weight" and cfg.tie_word_embeddings:
                            tied_head = f.get_tensor(name)
                        elif not name.endswith(_IGNORABLE):
                            unused.append(name)
                        continue
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ModelConfigError(
                            f"tensor {name} in {file.name} has shape {tuple(tensor.shape)}, "
                            f"the model expects {tuple(param.shape)}"
                        )
                    if tensor.dtype == torch.float8_e4m3fn:
                        fp8[name] = tensor
                    else:
                        param.copy_(tensor)
                    loaded.add(name)
        if fp8 and cfg.fp8_block is None:
            raise ModelConfigError(f"tensor {next(iter(fp8))} is fp8 but config.json has no "
                             "quantization_config")
        for name, tensor in fp8.items():
            if name not in scales:
                raise ModelConfigError(f"fp8 tensor {name} has no {name}_scale_inv in the checkpoint")
            params[name].copy_(_dequantize_fp8(tensor, scales.pop(name), cfg.fp8_block, name))
        unused += [f"{name}_scale_inv" for name in scales]
    if unused:
        shown = ", ".join(sorted(unused)[:8]) + (f" (+{len(unused) - 8} more)" if len(unused) > 8 else "")
        raise ModelConfigError(f"checkpoint {path} has tensor(s) pd does not know what to do with: {shown}")
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ModelConfigError(f"checkpoint {path} lacks tensor(s) the model needs: {shown}")
    if tied_head is not None and not torch.equal(
            tied_head.to(params["model.embed_tokens.weight"].dtype).cpu(),
            params["model.embed_tokens.weight"].cpu()):
        raise ModelConfigError("config.json tie_word_embeddings=True but the checkpoint's lm_head.weight "
                         "differs from model.embed_tokens.weight")
    return model.to(dtype=dtype).eval()
