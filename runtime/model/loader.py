"""Make a model: random weights from a seed, or a local HF safetensors checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from runtime.model.config import ModelConfig
from runtime.model.model import CausalLM

WEIGHTS_FILE = "model.safetensors"


class _SkipInit(TorchFunctionMode):
    """Modules built under this mode skip their default initialisation (`torch.nn.init`): the
    parameters are filled next anyway (`init_random`, a checkpoint). On the meta device that
    initialisation runs Python decompositions that import torch._dynamo: seconds of CPU in
    every process that builds a model."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def _materialize(config: ModelConfig, device: str | torch.device) -> CausalLM:
    """Allocate the model's parameters on `device` in the config's dtype, uninitialised."""
    with torch.device("meta"), _SkipInit():
        model = CausalLM(config)
    model = model.to(dtype=getattr(torch, config.dtype)).to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives each module its own new tensor
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def build_model(config: ModelConfig, *, seed: int = 0,
                device: str | torch.device = "cpu") -> CausalLM:
    """A model with random weights drawn from `seed` alone (the same on every device).

    Matrices get N(0, 1/fan_in) entries, so logits come out O(1) and greedy decoding has clear
    winners; norm weights are 1 and biases N(0, 0.02^2).
    """
    model = _materialize(config, device)
    init_random(model, seed)
    return model


def init_random(module: torch.nn.Module, seed: int) -> None:
    """Fill `module`'s parameters from `seed` alone, as `build_model` does."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            if name.endswith(".bias"):
                value = torch.randn(param.shape, generator=gen) * 0.02
            elif param.dim() == 1:
                value = torch.ones(param.shape)
            else:
                value = torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5
            param.copy_(value)


def load_model(path: str | Path, *, device: str | torch.device = "cpu",
               dtype: str | None = None) -> CausalLM:
    """Load `config.json` and the `*.safetensors` files of a local HF checkpoint directory."""
    config = ModelConfig.from_hf_config(path)
    if dtype is not None:
        config = config.with_(dtype=dtype)
    model = _materialize(config, device)
    load_safetensors(model, path)
    return model


def load_safetensors(model: CausalLM, path: str | Path, *, strict: bool = True) -> None:
    """Copy every tensor of the directory's `*.safetensors` files into the model's parameters.

    Names are the HF ones. With `strict`, a checkpoint tensor the model lacks, or a model
    parameter the checkpoint lacks (other than a tied `lm_head.weight`), raises ValueError.
    """
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    state = model.state_dict()
    loaded, unexpected = set(), []
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as st:
                for name in st.keys():
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    if name not in state:
                        unexpected.append(name)
                        continue
                    tensor = st.get_tensor(name)
                    if tensor.shape != state[name].shape:
                        raise ValueError(f"{file.name}: {name} has shape {tuple(tensor.shape)}, "
                                         f"the model expects {tuple(state[name].shape)}")
                    state[name].copy_(tensor)
                    loaded.add(name)
    missing = set(state) - loaded
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if strict and (missing or unexpected):
        raise ValueError(f"checkpoint {path} does not match the model: missing "
                         f"{sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")


def save_safetensors(model: CausalLM, path: str | Path) -> Path:
    """Write `config.json` and `model.safetensors` (HF names) into directory `path`."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(model.config.to_hf_config(), indent=2))
    return out
