"""What type checkers see: py.typed ships, return types are annotated, and return_lse /
return_residual pick between an array and an (out, lse) pair through typing.overload."""

from __future__ import annotations

import importlib.resources
import inspect
import typing

import pytest

import pallas_flash as pf

# (function, the flag that adds the lse/residual to the result)
WITH_LSE = [(pf.flash_attention, "return_lse"), (pf.reference_attention, "return_lse"),
            (pf.dot_product_attention, "return_residual"), (pf.decode_attention, "return_lse")]
PAIR = "tuple[jax.Array, jax.Array]"


def test_py_typed_marker_is_in_the_package():
    assert importlib.resources.files("pallas_flash").joinpath("py.typed").is_file()


@pytest.mark.parametrize("fn, flag", WITH_LSE, ids=lambda x: getattr(x, "__name__", x))
def test_overloads_return_a_pair_exactly_when_asked(fn, flag):
    returns = {}
    for overload in typing.get_overloads(fn):
        annotations = overload.__annotations__
        returns[annotations[flag]] = annotations["return"]
    assert returns == {"Literal[False]": "jax.Array", "Literal[True]": PAIR,
                       "bool": f"jax.Array | {PAIR}"}
    # The overloads take the implementation's parameters, in its order.
    implementation = list(inspect.signature(fn).parameters)
    for overload in typing.get_overloads(fn):
        assert list(inspect.signature(overload).parameters) == implementation


@pytest.mark.parametrize("fn", [pf.flash_attention, pf.reference_attention,
                                pf.dot_product_attention, pf.segment_ids_from_cu_seqlens,
                                pf.default_config], ids=lambda f: f.__name__)
def test_return_annotations(fn):
    assert inspect.signature(fn).return_annotation is not inspect.Signature.empty
