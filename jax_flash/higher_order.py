"""Derivatives of the kernels' gradients: XLA's, so that `jax.grad` of a
gradient, Hessian-vector products (`jax.jvp` of `jax.grad`) and
`jax.hessian` work on the kernel path as they do on
`jax.nn.dot_product_attention`'s XLA one.

The kernels' `jax.custom_vjp` gives first-order gradients from the backward
kernels, and Pallas cannot differentiate a kernel again (a `pallas_call`
inside a derivative fails deep in Pallas). Here the gradients' own
derivatives are taken by autodiff of the materialised reference
(`reference.reference_attention`): exact in real arithmetic, O(N^2) memory,
and only in what differentiates a gradient again. A first-order `jax.grad`
runs the kernels alone, as before.

Forward mode inside a gradient (the forward that `jax.grad` differentiates,
under an outer `jax.jvp`) gets its tangents from XLA too (`_forward`).
Forward mode of the attention itself (`jax.jvp`, `jax.jacfwd` of it) stays
unsupported on the kernels: a function is either a custom VJP (the kernels'
O(N) backward) or a custom JVP; the error says to use
`implementation="xla"`.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

# fn(diff_args, other_args) -> outputs: diff_args a pytree of the
# differentiable arrays, other_args one of everything else the call reads
# (integer masks, offsets), so that no array is closed over.
AttentionFn = Callable[[Any, Any], Any]


def with_reference_derivatives(kernel_fn: AttentionFn, xla_fn: AttentionFn,
                               diff_args, other_args):
  """kernel_fn(diff_args, other_args), its gradients the kernels' own (its
  custom VJP), their derivatives xla_fn's.

  kernel_fn and xla_fn compute the same function of their arguments and
  close over no arrays (JAX's custom derivatives take arrays as arguments).
  """
  try:
    return _attention(kernel_fn, xla_fn, diff_args, other_args)
  except TypeError as e:
    if "forward-mode" not in str(e):
      raise
    raise TypeError(
        "the attention kernels are differentiated in reverse mode (grad, "
        "vjp, and grad or jvp of those: Hessian-vector products, "
        "jax.hessian); forward mode of the attention itself (jax.jvp, "
        "jax.jacfwd of it) needs implementation='xla'") from e


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(kernel_fn, xla_fn, diff_args, other_args):
  del xla_fn
  return kernel_fn(diff_args, other_args)


def _attention_fwd(kernel_fn, xla_fn, diff_args, other_args):
  outputs, kernel_vjp = _forward(kernel_fn, xla_fn, diff_args, other_args)
  return outputs, (kernel_vjp, diff_args, other_args)


def _attention_bwd(kernel_fn, xla_fn, residuals, cotangents):
  del kernel_fn
  kernel_vjp, diff_args, other_args = residuals
  return (_gradients(xla_fn, kernel_vjp, diff_args, other_args, cotangents),
          None)


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _forward(kernel_fn, xla_fn, diff_args, other_args):
  """(outputs, kernel_vjp): the kernels' forward and their `jax.vjp`
  pullback, whose leaves are the backward's residuals.

  A custom JVP so that the forward that a gradient is taken of can be
  differentiated in forward mode too (`jax.jvp` of `jax.grad`, as a
  Hessian-vector product or `jax.hessian` is written): its outputs'
  tangents are XLA's."""
  del xla_fn
  return jax.vjp(lambda d: kernel_fn(d, other_args), diff_args)


@_forward.defjvp
def _forward_jvp(kernel_fn, xla_fn, primals, tangents):
  """The outputs' tangents by XLA; the residuals' are zeros, unused: only
  `_gradients` reads them, and its derivative recomputes them."""
  diff_args, other_args = primals
  diff_tangents, _ = tangents
  outputs, kernel_vjp = _forward(kernel_fn, xla_fn, diff_args, other_args)
  _, output_tangents = jax.jvp(lambda d: xla_fn(d, other_args), (diff_args,),
                               (diff_tangents,))
  return ((outputs, kernel_vjp),
          (output_tangents, jax.tree.map(_zero_tangent, kernel_vjp)))


def _zero_tangent(x):
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _gradients(xla_fn, kernel_vjp, diff_args, other_args, cotangents):
  """The kernels' gradients of diff_args (`kernel_vjp`, a `jax.vjp`
  pullback holding their residuals) for the outputs' `cotangents`."""
  del xla_fn, diff_args, other_args
  return kernel_vjp(cotangents)[0]


@_gradients.defjvp
def _gradients_jvp(xla_fn, primals, tangents):
  """The gradients' tangent by XLA, through diff_args and the cotangents.

  The residuals in kernel_vjp (the forward's O and LSE) are functions of
  diff_args that the XLA gradients recompute, so their tangents, already
  counted there, are ignored."""
  kernel_vjp, diff_args, other_args, cotangents = primals
  _, diff_tangents, _, cotangent_tangents = tangents

  def xla_gradients(diff, cts):
    return jax.vjp(lambda d: xla_fn(d, other_args), diff)[1](cts)[0]

  _, gradient_tangents = jax.jvp(xla_gradients, (diff_args, cotangents),
                                 (diff_tangents, cotangent_tangents))
  gradients = _gradients(xla_fn, kernel_vjp, diff_args, other_args,
                         cotangents)
  return gradients, gradient_tangents
