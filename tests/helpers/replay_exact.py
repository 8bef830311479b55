"""The exactness grid of joint replay against naive stock-MCore training, its bounds
(fp64 1e-12, fp32 1e-6 relative per tensor) and its case ids."""

import torch

TOL = {torch.float64: 1e-12, torch.float32: 1e-6}
DTYPES = {"f64": torch.float64, "f32": torch.float32}


def _assert_close_rel(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    err = float((got.double() - ref.double()).abs().max() / ref.double().abs().max())
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


# Pairwise covering array over the grid (every pair of values of any two factors occurs in
# some row; in particular every listed value appears). Columns:
#   dtype, G, W (wave size: 1 | 3 | G), R, arch (prelude + coda + linear_concat injection),
#   checkpoint_waves, normalization, loop weights, kl (kl_coef > 0 with ref_logprobs),
#   looped_prefix_attention, naive responses per microbatch (1 | 2 | all G).
GRID = [
    ("f32", 8, "1", 3, True, True, "seq_mean", "uniform", 1, "cascade", "all"),
    ("f64", 1, "G", 1, False, False, "constant", "progressive", 0, "cascade", "1"),
    ("f64", 5, "3", 3, True, False, "token_mean", "final", 1, "concat", "2"),
    ("f32", 2, "3", 1, False, True, "seq_mean", "final", 0, "concat", "all"),
    ("f32", 2, "G", 3, True, True, "constant", "progressive", 1, "concat", "2"),
    ("f64", 8, "1", 1, False, True, "token_mean", "uniform", 0, "concat", "2"),
    ("f32", 1, "1", 3, True, False, "seq_mean", "final", 1, "concat", "1"),
    ("f32", 5, "G", 3, False, False, "token_mean", "uniform", 0, "cascade", "all"),
    ("f64", 2, "3", 1, True, True, "constant", "uniform", 0, "cascade", "1"),
    ("f64", 5, "1", 1, True, True, "seq_mean", "progressive", 1, "cascade", "2"),
    ("f64", 8, "G", 3, False, False, "constant", "final", 1, "cascade", "all"),
    ("f32", 1, "3", 1, False, True, "token_mean", "progressive", 1, "cascade", "all"),
    ("f32", 2, "1", 3, False, False, "token_mean", "final", 1, "cascade", "1"),
    ("f32", 1, "G", 3, True, True, "seq_mean", "uniform", 0, "concat", "2"),
    ("f32", 5, "1", 3, True, False, "constant", "uniform", 0, "cascade", "1"),
    ("f64", 8, "3", 1, True, True, "constant", "progressive", 0, "concat", "1"),
]


def _case_id(row) -> str:
    dt, G, W, R, arch, ck, norm, lw, kl, attn, mb = row
    return (f"{dt}-G{G}-W{W}-R{R}-{'arch' if arch else 'plain'}-{'ckpt' if ck else 'nockpt'}-"
            f"{norm}-{lw}-kl{kl}-{attn}-mb{mb}")
