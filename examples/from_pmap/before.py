"""A Flax training script written for ``jax.pmap`` (``before.py``), as Flax's own examples
write one: its own ``TrainState`` carrying BatchNorm's ``batch_stats``, BatchNorm and the
gradients averaged over ``axis_name="batch"``, a weight penalty inside the loss, SGD with
a warmup-cosine schedule, and its own metrics; and the same script data-parallel on jdp's
mesh (``after.py``), its step, state, model and metrics as they were. docs/adopt.md shows
the difference, line by line.

    python examples/from_pmap/before.py --steps 200
    python examples/from_pmap/after.py --steps 200
"""

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils
from flax import linen as nn
from flax.training import train_state

WEIGHT_DECAY = 1e-4


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(64)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name="batch")(x)
        return nn.Dense(10)(nn.relu(x))


class TrainState(train_state.TrainState):
    batch_stats: Any


def create_train_state(rng, steps):
    model = Net()
    variables = model.init(rng, jnp.ones((1, 64)), train=False)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.1, max(1, steps // 10), steps)
    return TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=optax.sgd(schedule, momentum=0.9, nesterov=True),
    )


def train_step(state, batch):
    def loss_fn(params):
        variables = {"params": params, "batch_stats": state.batch_stats}
        logits, updates = state.apply_fn(
            variables, batch["image"], train=True, mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        kernels = [w for w in jax.tree.leaves(params) if w.ndim > 1]
        penalty = 0.5 * WEIGHT_DECAY * sum(jnp.sum(w**2) for w in kernels)
        return loss + penalty, (loss, logits, updates)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, (loss, logits, updates)), grads = grad_fn(state.params)
    grads = jax.lax.pmean(grads, axis_name="batch")
    state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
    metrics = {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}
    return state, jax.lax.pmean(metrics, axis_name="batch")


def batches(batch_size, seed=0):
    """8x8 images of noise, labelled by a fixed random linear teacher."""
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(64, 10)).astype(np.float32)
    while True:
        image = rng.normal(size=(batch_size, 64)).astype(np.float32)
        yield {"image": image, "label": np.argmax(image @ teacher, -1).astype(np.int32)}


def shard(batch, count):
    return jax.tree.map(lambda x: x.reshape(count, -1, *x.shape[1:]), batch)


def train(steps=200, batch_size=128, devices=None):
    devices = devices or jax.local_devices()
    state = create_train_state(jax.random.key(0), steps)
    state = jax_utils.replicate(state, devices)
    p_train_step = jax.pmap(train_step, axis_name="batch", devices=devices)
    data, history = batches(batch_size), []
    for _ in range(steps):
        state, metrics = p_train_step(state, shard(next(data), len(devices)))
        history.append(jax.device_get(jax_utils.unreplicate(metrics)))
    return jax_utils.unreplicate(state), history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    state, history = train(parser.parse_args().steps)
    last = history[-1]
    print(f"step {int(state.step)}: loss {last['loss']:.4f}, accuracy {last['accuracy']:.3f}")
