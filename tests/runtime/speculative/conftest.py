"""Fixtures: the tiny V4.1 (f32) compiled with its DSpark graphs, engines over it."""

from __future__ import annotations

import pytest

from tests.runtime.conftest import make_engine

MODEL = "v4.1-flash-tiny"


@pytest.fixture(scope="session")
def tiny_v41(compiled):
    return compiled(MODEL)


@pytest.fixture
def engine(tiny_v41):
    return lambda **kw: make_engine(tiny_v41, MODEL, **kw)
