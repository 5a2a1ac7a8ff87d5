"""A numerics fingerprint: what decides whether two machines print the same figures.

Two machines give bit-identical training runs only when XLA compiles the same
vector code and the same library kernels for them. The CPU's model name does not
say so: two "AMD EPYC" generations compile other code, their float32 sums
reorder, and after a few hundred steps a model's test accuracy moves by a few
examples. The fingerprint hashes what does decide the bits:

- the JAX and jaxlib versions (XLA's code generation and kernels);
- the CPU's identification and the ISA features LLVM compiles for (vendor,
  family, model, and the SIMD extensions in ``/proc/cpuinfo``);
- the bits of a small fixed computation in the kinds of arithmetic the figures'
  models use (dots at several shapes and precisions, a convolution and its
  gradients, long reductions, the transcendental functions of GELU, tanh,
  softmax, layer norm and Adam's square root), under this process's
  ``XLA_FLAGS`` (``--xla_cpu_max_isa`` changes them).

Its inputs are dyadic rationals made from integers, so they are the same bits on
every machine; only the arithmetic can differ.

``python -m tools.numerics`` prints this machine's fingerprint.
"""

from __future__ import annotations

import hashlib
import os
import platform

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

# The ISA extensions that change the vector code XLA:CPU emits (LLVM's host features).
_ISA_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "amx", "bmi", "vnni", "asimd", "sve", "neon")


def cpu_identity() -> str:
    """Vendor, family, model and SIMD features of this CPU, as LLVM sees them."""
    fields: dict[str, str] = {}
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as file:
            for line in file:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break  # the first processor's block is enough
    flags = fields.get("flags", fields.get("Features", ""))
    isa = sorted(flag for flag in flags.split() if flag.startswith(_ISA_PREFIXES))
    ids = [fields.get(key, "") for key in ("vendor_id", "cpu family", "model", "CPU part")]
    return " ".join([platform.machine(), *ids, *isa])


def _dyadic(rng: np.random.Generator, *shape: int) -> jax.Array:
    """Values in [-1, 1) with 20 significant bits: exact in float32 everywhere."""
    return jnp.asarray(rng.integers(-(2**20), 2**20, size=shape) / 2**20, jnp.float32)


def _model(params: dict, x: jax.Array) -> jax.Array:
    """A convolution, layer norm, GELU, attention-style softmax and a dense head."""
    h = jax.lax.conv_general_dilated(
        x, params["conv"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    h = h.reshape(h.shape[0], -1, h.shape[-1])  # (batch, tokens, channels)
    mean = h.mean(-1, keepdims=True)
    h = (h - mean) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-6)
    h = jax.nn.gelu(h @ params["dense"])
    scores = jax.nn.softmax(h @ h.transpose(0, 2, 1) / 8.0, axis=-1)
    h = jnp.tanh(scores @ h).mean(1)
    return h @ params["head"]


def _loss(params: dict, x: jax.Array, labels: jax.Array) -> jax.Array:
    logits = _model(params, x)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))


def _computation(params, x, labels, a, b, v):
    loss, grads = jax.value_and_grad(_loss)(params, x, labels)
    adam = jax.tree.map(lambda g: g / (jnp.sqrt(g * g) + 1e-8), grads)
    return {
        "loss": loss,
        "grads": grads,
        "adam": adam,
        "dot_f32": a @ b,
        "dot_bf16": (a.astype(jnp.bfloat16) @ b.astype(jnp.bfloat16)).astype(jnp.float32),
        "dot_f16": (a.astype(jnp.float16) @ b.astype(jnp.float16)).astype(jnp.float32),
        "sum": jnp.sum(v),
        "exp_log": jnp.mean(jnp.log1p(jnp.exp(v))),
        "sigmoid": jnp.sum(jax.nn.sigmoid(v * 4.0)),
    }


def fingerprint() -> str:
    """This machine's numerics fingerprint: 12 hex digits.

    Examples:
        >>> from tools import numerics
        >>> key = numerics.fingerprint()
        >>> len(key), key == numerics.fingerprint()
        (12, True)
    """
    rng = np.random.default_rng(20261124)
    params = {
        "conv": _dyadic(rng, 3, 3, 3, 16),
        "dense": _dyadic(rng, 16, 32),
        "head": _dyadic(rng, 32, 10),
    }
    x = _dyadic(rng, 8, 12, 12, 3)
    labels = jnp.asarray(rng.integers(0, 10, size=8), jnp.int32)
    a, b, v = _dyadic(rng, 129, 257), _dyadic(rng, 257, 65), _dyadic(rng, 100_003)
    results = jax.jit(_computation)(params, x, labels, a, b, v)
    digest = hashlib.sha256()
    digest.update(f"jax {jax.__version__} jaxlib {jaxlib.__version__}\n".encode())
    digest.update(cpu_identity().encode())
    for leaf in jax.tree.leaves(results):
        digest.update(np.asarray(leaf).tobytes())
    return digest.hexdigest()[:12]


if __name__ == "__main__":
    print(fingerprint())
