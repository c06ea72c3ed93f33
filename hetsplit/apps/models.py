"""Models: the built-in models the CLI profiles and benchmarks, and loading a user's own."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable
from typing import Literal, overload

import torch
from torch import nn

__all__ = [
    "ModelSpec",
    "LeNet",
    "CNN",
    "MLP",
    "BUILTIN_MODELS",
    "cnn",
    "lenet",
    "resnet18",
    "mlp",
    "load_model",
    "build_model",
    "synthetic_batch",
]


class LeNet(nn.Sequential):
    """LeNet-5 as built by :func:`lenet`: its own class, so a profile of it is named LeNet, not Sequential."""


class CNN(nn.Sequential):
    """The small CNN built by :func:`cnn`."""


class MLP(nn.Sequential):
    """The two-layer perceptron built by :func:`mlp`."""


def lenet(num_classes: int = 10) -> nn.Module:
    """LeNet-5 for 1x28x28 images (the course's multi-GPU example network), no BatchNorm."""
    return LeNet(
        nn.Conv2d(1, 6, kernel_size=5, padding=2), nn.ReLU(),
        nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Conv2d(6, 16, kernel_size=5), nn.ReLU(),
        nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120), nn.ReLU(),
        nn.Linear(120, 84), nn.ReLU(),
        nn.Linear(84, num_classes),
    )  # fmt: skip


def cnn(num_classes: int = 10) -> nn.Module:
    """A small CNN for 3x32x32 images (CIFAR-sized): three 3x3 convolutions, the demo's default.

    Its step is dominated by convolution arithmetic rather than Python, as a real
    training step is, so a split's gain is not eaten by per-step overhead.
    """
    return CNN(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, num_classes),
    )  # fmt: skip


def resnet18(num_classes: int = 10, in_channels: int = 1) -> nn.Module:
    """torchvision's ResNet-18 adapted to small 1-channel images (Fashion-MNIST)."""
    import torchvision

    net: nn.Module = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


def mlp(num_classes: int = 10, width: int = 256, in_features: int = 256) -> nn.Module:
    """A small two-layer perceptron; the workload of the quick built-in calibration."""
    return MLP(nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, num_classes))


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model the CLI can build, with the shape of one input sample.

    Attributes:
        name: The name on the command line, or ``package.module:factory``.
        factory: Builds the model.
        input_shape: Shape of one sample, without the batch dimension.
        num_classes: Classes of the output (targets are drawn in ``range(num_classes)``);
            ``None`` when the output is no ``(batch, classes)`` tensor of logits.
        output: What the model's output was found to be, for the error when it is needed
            as logits.
        vocab: Token ids: inputs are integers drawn from ``range(vocab)``; ``None``: float inputs.
        takes_ids: Whether the model failed on float inputs but ran on integer ones (token ids).
    """

    name: str
    factory: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    num_classes: int | None = 10
    output: str = ""
    vocab: int | None = None
    takes_ids: bool = False


BUILTIN_MODELS: dict[str, ModelSpec] = {
    "cnn": ModelSpec("cnn", cnn, (3, 32, 32)),
    "lenet": ModelSpec("lenet", lenet, (1, 28, 28)),
    "resnet18": ModelSpec("resnet18", resnet18, (1, 32, 32)),
    "mlp": ModelSpec("mlp", mlp, (256,)),
}


def load_model(name: str, input_shape: tuple[int, ...] | None = None, vocab: int | None = None) -> ModelSpec:
    """Resolve a built-in model name or ``package.module:factory`` to a :class:`ModelSpec`.

    Args:
        name: ``cnn``, ``lenet``, ``resnet18``, ``mlp``, or ``package.module:factory`` where
            ``factory()`` returns an ``nn.Module``.
        input_shape: Shape of one sample; required for a user's model.
        vocab: A user's model takes token ids: its inputs are integers in ``range(vocab)``.

    Returns:
        The :class:`ModelSpec`, with the classes of a user's model's output found by one forward.

    Raises:
        ValueError: If the name is unknown, the factory cannot be imported, or a user
            model comes without ``input_shape``.
    """
    if name in BUILTIN_MODELS:
        spec = BUILTIN_MODELS[name]
        return dataclasses.replace(spec, input_shape=tuple(input_shape)) if input_shape else spec
    if ":" not in name:
        raise ValueError(f"unknown model {name!r}; use one of {sorted(BUILTIN_MODELS)} or 'package.module:factory'")
    module_name, _, attr = name.partition(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        # mymodels.py in the current directory imports, as with `python -m`; at the end of the
        # path, so that no file here (a statistics.py) shadows the standard library.
        sys.path.append(os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load model factory {name!r}: {e}; check the module is importable") from e
    if not callable(factory):
        raise ValueError(f"model factory {name!r} is not callable")
    if not input_shape:
        raise ValueError(f"model {name!r} needs --input-shape, the shape of one sample such as 3,32,32")
    classes, output, takes_ids = _output_classes(factory, tuple(input_shape), vocab)
    return ModelSpec(name, factory, tuple(input_shape), classes, output, vocab, takes_ids)


def _output_classes(
    factory: Callable[[], nn.Module], shape: tuple[int, ...], vocab: int | None = None
) -> tuple[int | None, str, bool]:
    """``(C, "", takes_ids)`` or ``(None, why not, takes_ids)`` for a user model, from one forward of two samples.

    demo and bench draw targets in ``range(C)``; ``takes_ids``: float inputs failed where token ids ran.
    """
    gen = torch.Generator().manual_seed(0)
    sample = torch.randint(0, vocab, (2, *shape), generator=gen) if vocab else torch.randn(2, *shape, generator=gen)
    takes_ids = False
    try:
        model = factory()
        if not isinstance(model, nn.Module):
            return None, f"is built by a factory returning {type(model).__name__}", False
        with torch.no_grad():
            try:
                out = model(sample)
            except Exception:
                if vocab:
                    raise
                # An embedding refuses floats: try ids, so that the CLI can ask for --vocab-size.
                out = model(torch.zeros(2, *shape, dtype=torch.long))
                takes_ids = True
    except Exception as e:  # build_model and the step report it in full; here only why there are no classes
        return None, f"could not be computed ({type(e).__name__}: {str(e)[:120]})", False
    if isinstance(out, torch.Tensor) and out.is_floating_point() and out.dim() == 2 and out.shape[1] >= 1:
        return int(out.shape[1]), "", takes_ids
    what = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
    return None, f"is {what}", takes_ids


@overload
def synthetic_batch(
    spec: ModelSpec, batch: int, *, seed: int = 0, dtype: torch.dtype = torch.float32, targets: Literal[True] = True
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def synthetic_batch(
    spec: ModelSpec, batch: int, *, seed: int = 0, dtype: torch.dtype = torch.float32, targets: bool
) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def synthetic_batch(
    spec: ModelSpec, batch: int, *, seed: int = 0, dtype: torch.dtype = torch.float32, targets: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A synthetic (random) batch of inputs and class targets for ``spec`` (no targets with ``targets=False``).

    Raises:
        ValueError: If targets are asked for and the model's output is no ``(batch, classes)``
            tensor of logits (demo and bench train with cross-entropy), naming what it is.
    """
    if targets and spec.num_classes is None:
        raise ValueError(
            f"model {spec.name!r}: demo and bench train it with cross-entropy on logits of shape (batch, classes), "
            f"but its output {spec.output}; give a classifier, or time any model with 'hetsplit profile'"
        )
    gen = torch.Generator().manual_seed(seed)
    if spec.vocab:  # token ids (int64), whatever the parameters' dtype
        x = torch.randint(0, spec.vocab, (batch, *spec.input_shape), generator=gen)
    else:
        x = torch.randn((batch, *spec.input_shape), generator=gen, dtype=dtype)
    y = None
    if targets and spec.num_classes is not None:
        y = torch.randint(0, spec.num_classes, (batch,), generator=gen)
    return x, y


def build_model(spec: ModelSpec) -> nn.Module:
    """``spec.factory()``, checked to be an ``nn.Module``.

    Raises:
        ValueError: If the factory fails or returns something else, naming it.
    """
    try:
        model = spec.factory()
    except Exception as e:
        raise ValueError(f"model factory {spec.name!r} failed: {type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise ValueError(f"model factory {spec.name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model
