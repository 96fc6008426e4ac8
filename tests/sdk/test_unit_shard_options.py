"""Ledger.shard's options: one set of names, one set of defaults, each documented."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from shard_client import Ledger
from shard_client.options import ShardOptionKwargs, ShardOptions


def test_the_keyword_options_and_the_dataclass_name_the_same_fields() -> None:
    names = [field.name for field in dataclasses.fields(ShardOptions)]
    assert list(ShardOptionKwargs.__annotations__) == names


@pytest.mark.parametrize("field", dataclasses.fields(ShardOptions), ids=lambda f: f.name)
def test_ledger_shard_docstring_documents_every_option_with_its_default(
    field: dataclasses.Field[object],
) -> None:
    assert f"``{field.name}={field.default!r}``" in (Ledger.shard.__doc__ or "")


def test_given_options_are_normalized_and_the_rest_default() -> None:
    options = ShardOptions.given(expected_outputs=iter(["a", "b"]), output_dir=Path("/tmp/x"))
    assert options.expected_outputs == ("a", "b")
    assert options.output_dir == "/tmp/x"
    assert options == dataclasses.replace(
        ShardOptions(), expected_outputs=("a", "b"), output_dir="/tmp/x"
    )
    assert ShardOptions.given(heartbeat_timeout=8.0).interval == 2.0


def test_given_refuses_an_unknown_option_and_a_bad_value() -> None:
    misspelt: dict[str, Any] = {"heartbeat_timout": 1.0}
    with pytest.raises(TypeError):
        ShardOptions.given(**misspelt)
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        ShardOptions.given(heartbeat_timeout=0)
