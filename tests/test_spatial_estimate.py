"""The estimator over a split volume (zero/estimate/spatial.py; docs/spatial.md, "Estimating"): the
trace of one rank's slab predicts that rank's halo bytes (and every other spatial collective)
exactly and its allocator peak to 15%, against a real 2-rank run, and leaves the model as it was;
the command line prints the slab, the activations and the halo per rank, finds the largest cube
that fits a budget, and names what it refuses."""
import re

import pytest
import torch

from zero.estimate import estimate_activations, estimate_memory, format_bytes
from zero.models import UNet3D

VOLUME = (2, 1, 16, 8, 8)
UNEVEN = (2, 1, 12, 8, 8)  # 12, 6, 3 planes: the deepest level splits 2 + 1


def unet() -> UNet3D:
    torch.manual_seed(0)
    return UNet3D(width=4, depth=3)


def loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().sum()


def _real_steps(volumes: list[tuple[int, ...]]) -> list[dict]:
    """On each rank of a group of 2: the estimates of an unsplit U-Net at P=2 and P=1 for the first
    volume (here, where the CPU kernels' scratch is this process's), then one forward and backward
    of the U-Net over each volume split across the group: the Comm's counts and the allocator's
    peak, each gradient handed on as the engine does (dropped); then, for the first volume, the
    estimate of the model split already, which must leave it split and working."""
    import zero.spatial as sp
    from zero.parallel.comm import Comm
    from zero.probes import AllocatorPeak

    runs = [{} for _ in volumes]
    runs[0] = {"split": estimate_activations(unet(), (torch.empty(volumes[0]),), loss=loss, spatial_parallel_size=2),
               "whole": estimate_activations(unet(), (torch.empty(volumes[0]),), loss=loss)}
    comm = Comm()
    model = sp.parallelize(unet(), comm)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    for volume, run in zip(volumes, runs):
        x = sp.shard_volume(torch.randn(volume, generator=torch.Generator().manual_seed(1)), comm)
        comm.reset_counts()
        with AllocatorPeak() as peak:
            value = loss(model(x))
            value.backward()
            del value
        run.update(rank=comm.rank, counts=comm.report(), peak=peak.peak)
    volume = volumes[0]
    runs[0]["split_already"] = estimate_activations(model, (torch.empty(volume),), loss=loss, spatial_parallel_size=2,
                                                    kernel_scratch=False)
    with torch.no_grad():
        x = sp.shard_volume(torch.randn(volume), comm)
        runs[0]["still_split"] = sp.gather_volume(model(x), comm).shape[2] == volume[2]  # over the real group
    return runs


def test_the_trace_of_a_slab_predicts_the_halo_bytes_and_the_peak_of_a_real_run(dist_run):
    model = unet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = [type(m) for m in model.modules()]
    estimates = [estimate_activations(model, (torch.empty(v),), loss=loss, spatial_parallel_size=2,
                                      kernel_scratch=False) for v in (VOLUME, UNEVEN)]
    # the model is as it was: its classes, no plan, no hooks, the same parameters
    assert [type(m) for m in model.modules()] == classes
    assert not any(k.startswith("_zero_spatial") for m in model.modules() for k in vars(m))
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [(e.slab, e.volume, e.spatial_rank) for e in estimates] == [((2, 1, 8, 8, 8), VOLUME, 0),
                                                                        ((2, 1, 6, 8, 8), UNEVEN, 0)]
    ranks = dist_run(2, _real_steps, [VOLUME, UNEVEN])
    for i, est in enumerate(estimates):
        real = next(runs[i] for runs in ranks if runs[i]["rank"] == est.spatial_rank)
        assert est.halo_bytes > 0 and est.halo_bytes == real["counts"]["spatial_halo"]["bytes"], (est, real)
        assert est.collectives == real["counts"], (est.collectives, real["counts"])  # the sizes and statistics too
    # the peak, traced where the real run ran (the CPU kernels' scratch depends on the threads)
    real = next(runs[0] for runs in ranks if runs[0]["rank"] == estimates[0].spatial_rank)
    split, whole = real["split"], real["whole"]
    assert split.saved == estimates[0].saved and split.collectives == estimates[0].collectives, (split, estimates[0])
    assert abs(split.peak / real["peak"] - 1) <= 0.15, (split.peak, real["peak"])
    assert split.peak < whole.peak, (split, whole)
    assert whole.halo_bytes == 0 and whole.slab == () and whole.collectives == {}
    # a model split already (zero.initialize with spatial_parallel_size) traces the same, and stays split
    again, est = real["split_already"], estimates[0]
    assert again == est and real["still_split"], (again, est)


def test_the_traced_rank_is_a_middle_one_with_the_widest_slab():
    est = estimate_activations(unet(), (torch.empty(1, 1, 20, 8, 8),), loss=loss, spatial_parallel_size=3,
                               kernel_scratch=False)
    assert est.spatial_rank == 1 and est.slab == (1, 1, 7, 8, 8)  # 20 planes: 7, 7, 6
    with pytest.raises(ValueError, match="16 planes along dimension 2, fewer than the 32 spatial ranks"):
        estimate_activations(unet(), (torch.empty(VOLUME),), spatial_parallel_size=32)
    with pytest.raises(ValueError, match="spatial_parallel_size must be a positive integer"):
        estimate_activations(unet(), (torch.empty(VOLUME),), spatial_parallel_size=0)


def run_cli(capsys, *argv: str) -> str:
    from zero.estimate.__main__ import main

    assert main(list(argv)) == 0
    return capsys.readouterr().out


def cli_error(capsys, *argv: str) -> str:
    from zero.estimate.__main__ import main

    with pytest.raises(SystemExit):
        main(list(argv))
    return capsys.readouterr().err


def test_the_command_line_prints_the_slab_and_the_halo_per_rank(capsys):
    out = run_cli(capsys, "--unet", "4", "3", "--volume", "64", "64", "64", "--spatial", "2", "--gpus", "2",
                  "--stage", "3", "--offload", "none")
    assert "slab 32 x 64 x 64 of 64 x 64 x 64 per rank (depth split over 2 ranks" in out, out
    with torch.device("meta"):
        model = UNet3D(4, 3)
    act = estimate_activations(model, (torch.empty(1, 1, 64, 64, 64, device="meta"),), dtype=torch.bfloat16,
                               spatial_parallel_size=2, kernel_scratch=False)
    assert "halo per rank and step: " in out and f"({act.halo_bytes:,} B, forward and backward)" in out, out
    peak = estimate_memory(model, 2, stage=3, offload="none", activations=act)[0].peak_bytes
    assert "1 data-parallel rank(s) x 2 spatial" in out, out
    assert re.search(rf"stage 3 .* {re.escape(format_bytes(peak))} ", out), out  # the table's peak/rank


def test_the_budget_gives_the_largest_cube_that_fits(capsys):
    out = run_cli(capsys, "--unet", "4", "3", "--spatial", "2", "--gpus", "2", "--budget", "200MiB")
    line = next(line for line in out.splitlines() if line.startswith("largest cube edge"))
    assert "(--stage not given: stage 3)" in line and "depth split over 2 ranks" in line, line
    edge, step = int(re.search(r": (\d+) \(", line).group(1)), int(re.search(r"steps of (\d+)", line).group(1))
    assert step == 4
    with torch.device("meta"):
        model = UNet3D(4, 3)

    def peak(e: int) -> int:
        act = estimate_activations(model, (torch.empty(1, 1, e, e, e, device="meta"),), dtype=torch.bfloat16,
                                   spatial_parallel_size=2, kernel_scratch=False)
        return estimate_memory(model, 2, stage=3, offload="none", activations=act)[0].peak_bytes

    assert peak(edge) <= 200 * 2**20 < peak(edge + step), (line, peak(edge), peak(edge + step))


@pytest.mark.parametrize("argv,message", [
    (["--unet", "4", "3", "--volume", "64", "64", "64", "--spatial", "3", "--gpus", "4"],
     "--spatial 3 must divide the 4 ranks"),
    (["--unet", "4", "3", "--volume", "16", "64", "64", "--spatial", "8", "--gpus", "8"],
     "the depth, 16 planes, is 4 plane(s) at the model's deepest level (16 / 4), too few to split over 8"),
    (["--unet", "4", "3", "--volume", "18", "64", "64"], "give edges that are multiples of 4"),
    (["--unet", "4", "3", "--spatial", "2", "--gpus", "2"], "--spatial splits a volume: give --volume"),
    (["--params", "1e6", "--volume", "64", "64", "64"], "--volume needs a 3D model"),
    (["--unet", "4", "3", "--budget", "80 apples"], "is not an amount of memory"),
])
def test_the_command_line_refuses_with_the_sizes_named(capsys, argv, message):
    assert message in cli_error(capsys, *argv)
