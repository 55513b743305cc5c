"""Load a Hugging Face model directory into `pd.model.CausalLM`.

Reads `config.json` and the weights (`model.safetensors`, or shards listed in
`model.safetensors.index.json`). A missing tensor or a tensor of the wrong shape is an error
naming it; tensors the model does not use (e.g. `lm_head.weight` with tied embeddings, an MTP
layer the config does not declare) are skipped. Tokenizer files are `pd.tokenizer`'s business.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from pd.config import ModelConfig
from pd.model import CausalLM

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


def load_model(path: str | Path, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for file in weight_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    param = params.get(name)
                    if param is None:
                        log.debug("skipping unused tensor %s", name)
                        continue
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ValueError(
                            f"tensor {name} in {file.name} has shape {tuple(tensor.shape)}, "
                            f"the model expects {tuple(param.shape)}"
                        )
                    param.copy_(tensor)
                    loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {path} lacks tensor(s) the model needs: {shown}")
    return model.to(dtype=dtype).eval()
