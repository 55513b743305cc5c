"""Load a Hugging Face model directory into `pd.model.llama.CausalLM`.

Reads `config.json` and the weights (`model.safetensors`, or shards listed in
`model.safetensors.index.json`). A missing tensor or a tensor of the wrong shape is an error
naming it, and so is a tensor the model has no place for (an MTP layer the config does not
declare, a bias the config does not ask for): nothing is skipped silently. Block-quantized fp8
weights (`*.weight` in float8_e4m3fn with `*.weight_scale_inv`) are dequantized at load. The
checkpoint's q/k/v and gate/up projections are stacked by rows into pd's fused `qkv_proj` and
`gate_up_proj` (`checkpoint_targets`). Under tensor parallelism (`pd.model.parallel`) each
rank takes its slice of each checkpoint tensor (`shard`) and the shapes checked are the slice's.
Tokenizer files are `pd.text.tokenizer`'s business.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn
from safetensors import safe_open

from pd.config import ModelConfig, ModelConfigError
from pd.model import parallel
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


# checkpoint projection -> (pd's fused projection, index of its part): pd stacks q/k/v and
# gate/up by rows so each runs as one matmul
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def checkpoint_targets(model: CausalLM) -> dict[str, tuple[str, int, int]]:
    """Every tensor name the checkpoint must hold -> (parameter name, first row, rows): the
    parameter itself, or the rows of a fused projection that the checkpoint stores apart."""
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp  # this rank's sizes
    rows = {"qkv_proj": (attn.q_size, attn.kv_size, attn.kv_size),
            "gate_up_proj": (mlp.intermediate_size, mlp.intermediate_size)}
    targets = {}
    for name, param in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")  # leaf: weight or bias
        module_prefix, _, proj = prefix.rpartition(".")
        if proj not in rows:
            targets[name] = (name, 0, param.shape[0])
            continue
        for part, (fused, index) in _STACKED.items():
            if fused == proj:
                sizes = rows[proj]
                targets[f"{module_prefix}.{part}.{leaf}"] = (name, sum(sizes[:index]), sizes[index])
    return targets


_COLUMN_PARALLEL = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.")
_ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight")
_VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


def shard(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of checkpoint tensor `name` (the whole tensor at size 1): rows of a
    column-parallel projection, columns of a row-parallel one, vocabulary rows of the
    embedding and LM head (padded with zero rows to the slice's size), else the whole."""
    tp = parallel.group()
    if tp.size == 1:
        return tensor
    if name in _VOCAB_PARALLEL:
        start, rows = parallel.vocab_shard(tensor.shape[0])
        part = tensor[start:start + rows]
        if part.shape[0] < rows:
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
        return part
    # NOTE: a tensor whose rows (columns) do not split evenly gives a slice of another shape,
    # which the caller's shape check names
    if any(p in name for p in _COLUMN_PARALLEL):
        return tensor.chunk(tp.size, dim=0)[tp.rank]
    if name.endswith(_ROW_PARALLEL):
        return tensor.chunk(tp.size, dim=1)[tp.rank]
    return tensor


def materialize(model: nn.Module, device: str | torch.device) -> None:
    """`model.to_empty(device=device)` for a model built on the meta device: each parameter and
    buffer replaced by an empty tensor of its shape and dtype on `device`. NOTE: to_empty goes
    through meta's `empty_like`, whose reference implementation imports torch.fx's symbolic
    shapes (0.5 s of every node's start on 2 cores); `torch.empty` does not."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                               requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.empty(b.shape, dtype=b.dtype, device=device))


def load_model(path: str | Path, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    """Every tensor of the checkpoint is used or refused: an unknown one is an error naming it
    (a feature pd lacks would otherwise be dropped silently), except RoPE tables some
    checkpoints carry and a tied LM head equal to the embeddings."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    materialize(model, device)
    params = dict(model.named_parameters())
    targets = checkpoint_targets(model)
    loaded: set[str] = set()
    unused: list[str] = []
    tied_head: torch.Tensor | None = None
    scales: dict[str, torch.Tensor] = {}
    fp8: dict[str, torch.Tensor] = {}

    def assign(name: str, tensor: torch.Tensor) -> None:
        param, start, num = targets[name]
        params[param][start:start + num].copy_(tensor)

    with torch.no_grad():
        for file in weight_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith("_scale_inv") and cfg.fp8_block is not None:
                        scales[name.removesuffix("_scale_inv")] = f.get_tensor(name)
                        continue
                    if name not in targets:
                        if name == "lm_head.weight" and cfg.tie_word_embeddings:
                            tied_head = shard(name, f.get_tensor(name))
                        elif not name.endswith(_IGNORABLE):
                            unused.append(name)
                        continue
                    full = f.get_tensor(name)
                    tensor = shard(name, full)
                    param, _, num = targets[name]
                    want = (num, *params[param].shape[1:])
                    if tuple(tensor.shape) != want:
                        raise ModelConfigError(
                            f"tensor {name} in {file.name} has shape {tuple(tensor.shape)}, "
                            f"the model expects {want}"
                        )
                    if tensor.dtype == torch.float8_e4m3fn:
                        fp8[name] = full  # its scales' blocks are the whole tensor's
                    else:
                        assign(name, tensor)
                    loaded.add(name)
        if fp8 and cfg.fp8_block is None:
            raise ModelConfigError(f"tensor {next(iter(fp8))} is fp8 but config.json has no "
                                   "quantization_config")
        for name, tensor in fp8.items():
            if name not in scales:
                raise ModelConfigError(f"fp8 tensor {name} has no {name}_scale_inv in the checkpoint")
            assign(name, shard(name, _dequantize_fp8(tensor, scales.pop(name), cfg.fp8_block,
                                                     name)))
        unused += [f"{name}_scale_inv" for name in scales]
    if unused:
        shown = ", ".join(sorted(unused)[:8]) + (f" (+{len(unused) - 8} more)" if len(unused) > 8 else "")
        raise ModelConfigError(f"checkpoint {path} has tensor(s) pd does not know what to do with: {shown}")
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ModelConfigError(f"checkpoint {path} lacks tensor(s) the model needs: {shown}")
    if tied_head is not None and not torch.equal(
            tied_head.to(params["model.embed_tokens.weight"].dtype).cpu(),
            params["model.embed_tokens.weight"].cpu()):
        raise ModelConfigError("config.json tie_word_embeddings=True but the checkpoint's "
                               "lm_head.weight differs from model.embed_tokens.weight")
    return model.to(dtype=dtype).eval()
