"""Shared fixtures of the Python tests: one narrow-flash layer step per family (the C++ layer tests'
narrow config: every paging constant of flash, small dense widths), whose inputs, pools and
intermediates feed the single-kernel tests. Run with PYTHONPATH=<build>/python (ctest sets it)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiledecode as td  # noqa: E402
from tiledecode import synthetic as syn  # noqa: E402

B, S = 2, 2
STARTS = (8192, 127)  # request 1, s = 0 closes a ratio-4 and a ratio-128 window (committed)


class Layer:
    """One layer step of `kind` at STARTS with MTP commit 1, everything kept for the tests
    (compressor_check: the Weights' opt-in compressor rounding check)."""

    def __init__(self, kind, cfg=None, starts=STARTS, seed=7, compressor_check=False):
        self.kind = kind
        self.cfg = cfg or td.Config("flash").narrow()
        self.B, self.S = len(starts), S
        self.T = self.B * self.S
        self.pools = td.pools_for_batch(self.B)
        self.tables = td.fixture_tables(self.B, self.pools, self.cfg)
        self.md = td.StepMetadata(self.B, self.S, self.cfg)
        self.ws = td.Workspace(self.B, self.S, self.cfg)
        self.w = syn.weights(kind, self.cfg, layer=kind, seed=seed)
        self.W = td.Weights(kind, self.w, self.cfg, compressor_check=compressor_check)
        self.before = syn.caches(kind, self.pools, self.cfg, layer=kind, seed=seed)
        self.caches = {k: v.clone() for k, v in self.before.items()}
        self.rope = td.rope_table(kind, config=self.cfg)
        self.starts = torch.tensor(starts, dtype=torch.int32)
        self.md.build(self.starts, self.S, 1, self.tables, self.pools)
        self.meta = {k: v.clone() for k, v in self.md.tensors().items()}
        self.x_hc = syn.x_hc(self.T, self.cfg, step=kind, seed=seed)
        self.x_out = torch.empty_like(self.x_hc)
        td.layer_step(self.x_out, self.x_hc, self.W, self.caches, self.md, self.rope, self.ws)
        self.v = {k: t.clone() for k, t in self.ws.tensors(self.B, self.S).items()}


@pytest.fixture(scope="session")
def swa():
    return Layer(td.SWA)


@pytest.fixture(scope="session")
def csa():
    return Layer(td.CSA)


@pytest.fixture(scope="session")
def hca():
    return Layer(td.HCA)


@pytest.fixture(scope="session")
def csa_checked():
    """The csa step with the compressors' rounding check (td.Weights(compressor_check=True))."""
    return Layer(td.CSA, compressor_check=True)


@pytest.fixture(scope="session")
def hca_checked():
    return Layer(td.HCA, compressor_check=True)


@pytest.fixture(scope="session")
def csa_pro():
    """CSA with the pro preset's schedule and top-k (1024: 1152 attention columns), narrow."""
    return Layer(td.CSA, cfg=td.Config("pro").narrow())


@pytest.fixture(scope="session")
def csa_flash():
    """The same CSA step at the flash preset's full widths (the default "flash" config)."""
    return Layer(td.CSA, cfg=td.Config("flash"))


def assert_close(actual, expected, rule):
    """rule = (atol, rtol, max_error_ratio): the spec's ratio_allclose."""
    import reference as ref
    ok, msg = ref.ratio_allclose(actual, expected, *rule)
    assert ok, msg
