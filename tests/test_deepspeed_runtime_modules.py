"""DeepSpeed's runtime helper modules under `import zero.deepspeed as deepspeed`: pipeline schedules
and topologies, runtime.utils, the lr_schedules helpers, config_utils / precision_config and the
module_inject Linear layers. Each has a test that needs no DeepSpeed; where DeepSpeed is installed,
a second test compares ours with it."""
import argparse
import importlib
import json
import math
import os

import pytest
import torch
from pydantic import Field

import zero.deepspeed as deepspeed
from zero.deepspeed._missing import NotAvailableError
from zero.deepspeed.runtime import config_utils, lr_schedules, precision_config
from zero.deepspeed.runtime import utils as ds_utils
from zero.deepspeed.runtime.pipe import schedule, topology
from zero.deepspeed.runtime.pipe.schedule import (
    BackwardPass,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)


def _real_deepspeed(module: str):
    """DeepSpeed's `module`, or a skip when DeepSpeed is not installed."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed", reason="the comparison needs DeepSpeed installed (a development tool only)")
    return importlib.import_module(module)


# ---------------------------------------------------------------------------------------------
# Pipeline schedules
# ---------------------------------------------------------------------------------------------

def test_pipeline_schedules_give_the_hand_checked_sequences_of_two_stages_and_three_micro_batches():
    # 1F1B: stage s runs forward m at step 2m + s and backward m at step 2m + 3 - s
    # (two stages), sending the previous step's result at the next step
    stage0 = [
        [LoadMicroBatch(0), ForwardPass(0)],
        [SendActivation(0)],
        [LoadMicroBatch(1), ForwardPass(1)],
        [RecvGrad(0), SendActivation(1), BackwardPass(0)],
        [LoadMicroBatch(0), ForwardPass(0)],
        [RecvGrad(1), SendActivation(0), BackwardPass(1)],
        [],
        [RecvGrad(0), BackwardPass(0), ReduceTiedGrads(), ReduceGrads(), OptimizerStep()],
    ]
    stage1 = [
        [],
        [RecvActivation(0), LoadMicroBatch(0), ForwardPass(0)],
        [BackwardPass(0)],
        [SendGrad(0), RecvActivation(1), LoadMicroBatch(1), ForwardPass(1)],
        [BackwardPass(1)],
        [SendGrad(1), RecvActivation(0), LoadMicroBatch(0), ForwardPass(0)],
        [BackwardPass(0)],
        [SendGrad(0), ReduceTiedGrads(), ReduceGrads(), OptimizerStep()],
    ]
    for stage_id, expected in enumerate([stage0, stage1]):
        train = schedule.TrainSchedule(micro_batches=3, stages=2, stage_id=stage_id)
        assert list(train) == expected, stage_id
        assert list(train) == expected  # iterating again starts over
        assert train.num_pipe_buffers() == 2
    # inference: stage s forwards micro-batch m at step m + s in buffer m % 2; even stages send first
    assert list(schedule.InferenceSchedule(3, 2, 0)) == [
        [LoadMicroBatch(0), ForwardPass(0)],
        [LoadMicroBatch(1), SendActivation(0), ForwardPass(1)],
        [LoadMicroBatch(0), SendActivation(1), ForwardPass(0)],
        [SendActivation(0)],
    ]
    assert list(schedule.InferenceSchedule(3, 2, 1)) == [
        [],
        [LoadMicroBatch(0), RecvActivation(0), ForwardPass(0)],
        [LoadMicroBatch(1), RecvActivation(1), ForwardPass(1)],
        [LoadMicroBatch(0), RecvActivation(0), ForwardPass(0)],
    ]
    assert list(schedule.InferenceSchedule(3, 3, 1))[1:3] == [[RecvActivation(0), ForwardPass(0)],
                                                              [RecvActivation(1), SendActivation(0), ForwardPass(1)]]
    assert list(schedule.DataParallelSchedule(2, 1, 0)) == [
        [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0)],
        [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0), ReduceGrads(), OptimizerStep()],
    ]
    # buffers: the forwards in flight (at least two)
    assert [schedule.TrainSchedule(8, 4, s).num_pipe_buffers() for s in range(4)] == [4, 3, 2, 2]
    assert schedule.TrainSchedule(1, 4, 0).num_pipe_buffers() == 2
    first, last = schedule.TrainSchedule(5, 3, 0), schedule.TrainSchedule(5, 3, 2)
    assert (first.is_first_stage, first.is_last_stage, last.is_last_stage, last.stage, last.num_stages,
            last.num_micro_batches, last.prev_stage, last.next_stage) == (True, False, True, 2, 3, 5, 1, 3)
    # instructions: attributes, readable repr, equality by value
    cmd = ForwardPass(buffer_id=1)
    assert (cmd.buffer_id, cmd.name, repr(cmd), cmd.kwargs) == (1, "ForwardPass", "ForwardPass(buffer_id=1)",
                                                               {"buffer_id": 1})
    assert ForwardPass(1) != BackwardPass(1) and len({ForwardPass(1), ForwardPass(1)}) == 1
    assert isinstance(cmd, schedule.BufferOpInstruction) and isinstance(OptimizerStep(), schedule.PipeInstruction)
    assert repr(OptimizerStep()) == "OptimizerStep()" and repr(schedule.CommitP2P()) == "CommitP2P()"
    assert repr(SendActivation(2, phase=1)) == "SendActivation(buffer_id=2, phase=1)"
    with pytest.raises(TypeError):
        schedule.PipeSchedule(1, 1, 0)  # abstract: a subclass writes steps()


def test_pipeline_schedules_yield_deepspeeds_instructions_step_for_step():
    theirs = _real_deepspeed("deepspeed.runtime.pipe.schedule")
    for name in ("TrainSchedule", "InferenceSchedule", "DataParallelSchedule"):
        for stages in range(1, 7):
            for micro_batches in range(1, 10):
                for stage_id in range(stages):
                    ours = getattr(schedule, name)(micro_batches, stages, stage_id)
                    ref = getattr(theirs, name)(micro_batches, stages, stage_id)
                    assert [repr(c) for c in ours] == [repr(c) for c in ref], (name, stages, micro_batches, stage_id)
                    assert ours.num_pipe_buffers() == ref.num_pipe_buffers()


# ---------------------------------------------------------------------------------------------
# Topology
# ---------------------------------------------------------------------------------------------

def test_topology_lays_ranks_out_as_zeros_pp_dp_tp_mesh():
    P, T, D = 2, 2, 3
    topo = topology.PipeModelDataParallelTopology(num_pp=P, num_mp=T, num_dp=D)
    assert topo.get_axis_names() == ["pipe", "data", "model"] and topo.world_size() == P * D * T
    for rank in range(P * D * T):
        c = topo.get_coord(rank)
        assert rank == (c.pipe * D + c.data) * T + c.model  # zero's [Note: the parallel mesh]
        assert topo.get_rank(pipe=c.pipe, data=c.data, model=c.model) == rank
    assert topo.get_dim("data") == D and topo.get_dim("expert") == 0
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]
    assert topo.get_axis_comm_lists("data")[:2] == [[0, 2, 4], [1, 3, 5]]
    assert topo.get_axis_comm_lists("expert") == []
    assert topo.filter_match(pipe=1, model=0) == [6, 8, 10] and topo.get_axis_list("data", 2) == [4, 5, 10, 11]
    assert topo.get_rank_repr(7) == "model_01" and topo.get_rank_repr(7, omit_axes=[]) == "pipe_01-data_00-model_01"
    two = topology.PipeDataParallelTopology(num_pp=2, num_dp=4)
    assert two.get_axis_comm_lists("data") == [[0, 1, 2, 3], [4, 5, 6, 7]] and str(two).startswith("{ProcessCoord(")
    assert topology.ProcessTopology(["x", "y"], [2, 3]).get_axis_list("y", 0) == [0, 3]
    with pytest.raises(ValueError, match="filter_match"):
        topo.get_rank(pipe=0)
    with pytest.raises(ValueError, match="outside"):
        topo.get_rank(pipe=2, data=0, model=0)
    with pytest.raises(ValueError, match="rank 12 not found"):
        topo.get_coord(12)
    assert [topology._prime_factors(n) for n in (1, 8, 12, 7)] == [[], [2, 2, 2], [2, 2, 3], [7]]


def test_topology_answers_as_deepspeeds_does():
    theirs = _real_deepspeed("deepspeed.runtime.pipe.topology")
    for ours, ref in [(topology.PipeModelDataParallelTopology(2, 3, 2), theirs.PipeModelDataParallelTopology(2, 3, 2)),
                      (topology.PipeDataParallelTopology(3, 2), theirs.PipeDataParallelTopology(3, 2)),
                      (topology.ProcessTopology(["a", "b", "c"], [2, 1, 3]), theirs.ProcessTopology(["a", "b", "c"],
                                                                                                    [2, 1, 3]))]:
        assert ours.world_size() == ref.world_size() and str(ours) == str(ref)
        for axis in ours.get_axis_names() + ["nope"]:
            assert ours.get_axis_comm_lists(axis) == ref.get_axis_comm_lists(axis)
            assert ours.get_dim(axis) == ref.get_dim(axis)
        for rank in range(ours.world_size()):
            assert tuple(ours.get_coord(rank)) == tuple(ref.get_coord(rank))
            assert ours.get_rank_repr(rank) == ref.get_rank_repr(rank)
            first = ours.get_axis_names()[0]
            assert ours.filter_match(**{first: 1}) == ref.filter_match(**{first: 1})
            assert ours.get_axis_list(first, 0) == ref.get_axis_list(first, 0)


def _grid_on_four_ranks():
    """Run on 4 gloo ranks: the grid's groups, the mpu helpers, PartitionedTensor, the TP Linears."""
    import torch.distributed as dist

    from zero.deepspeed.module_inject import LinearAllreduce, LinearLayer
    from zero.parallel.mesh import build_mesh

    rank = dist.get_rank()

    def group_sum(group):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        return int(t.item())

    # DeepSpeed's default split of 4 ranks: pipe 2 x data 2
    grid = topology.PipelineParallelGrid()
    assert (grid.pipe_parallel_size, grid.data_parallel_size, grid.model_parallel_size) == (2, 2, 1)
    assert grid.get_stage_id() == rank // 2 and grid.get_data_parallel_rank() == rank % 2
    assert grid.get_data_parallel_group_ranks() == [rank - rank % 2, rank - rank % 2 + 1]
    assert group_sum(grid.get_data_parallel_group()) == sum(grid.dp_group)
    assert group_sum(grid.get_pipe_parallel_group()) == sum(grid.pp_group) == 2 * (rank % 2) + 2
    assert group_sum(grid.get_slice_parallel_group()) == rank and grid.get_slice_parallel_rank() == 0
    assert grid.p2p_groups == [[0, 2], [1, 3], [2, 0], [3, 1]] and grid.stage_to_global(1) == 2 + rank % 2

    # pipe 2 x model 2: the same ranks as zero's (pp, dp, tp) mesh
    tp_grid = topology.PipelineParallelGrid(topology.PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1))
    mesh = build_mesh(2, 1, 2, torch.device("cpu"))
    assert all(mesh.rank_of(p, 0, t) == tp_grid.topology().get_rank(pipe=p, data=0, model=t)
               for p in range(2) for t in range(2))
    assert (tp_grid.get_tensor_model_parallel_rank(), tp_grid.get_tensor_model_parallel_world_size()) == (rank % 2, 2)
    assert group_sum(tp_grid.get_tensor_model_parallel_group()) == 2 * rank - rank % 2 * 2 + 1
    assert tp_grid.get_model_parallel_world_size() == 4 and group_sum(tp_grid.get_model_parallel_group()) == 6
    assert ds_utils.bwc_tensor_model_parallel_rank(tp_grid) == rank % 2
    assert ds_utils.bwc_pipeline_parallel_world_size(tp_grid) == 2

    # a norm over the model-parallel group: each rank holds one slice of a split parameter
    p = torch.nn.Parameter(torch.zeros(3))
    p.model_parallel = True
    p.grad = torch.full((3,), float(rank + 1))
    whole = math.sqrt(3 * sum((r + 1) ** 2 for r in range(4)))
    assert ds_utils.get_flattened_grad_norm([p], mpu=tp_grid) == pytest.approx(whole)
    assert float(ds_utils.clip_grad_norm_([p], max_norm=1.0, mpu=tp_grid)) == pytest.approx(whole, rel=1e-5)
    assert torch.allclose(p.grad, torch.full((3,), (rank + 1) / whole), rtol=1e-4)

    # PartitionedTensor: 10 elements over 4 ranks (3, 3, 2, 2)
    full = torch.arange(10.0).view(2, 5)
    part = ds_utils.PartitionedTensor(full, group=None)
    assert part.data().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0], [8.0, 9.0]][rank]
    assert torch.equal(part.full(), full)
    again = ds_utils.PartitionedTensor.from_meta(part.to_meta(), part.data(), group=None, device="cpu")
    assert torch.equal(again.full(), full) and again.full_size() == [2, 5]

    # the TP Linears on the model group equal one whole Linear, forward and backward
    group = tp_grid.get_slice_parallel_group()
    torch.manual_seed(0)
    up, down = torch.nn.Linear(4, 6), torch.nn.Linear(6, 4)
    x = torch.randn(5, 4, requires_grad=True)
    col, row = LinearLayer(up, mp_group=group), LinearAllreduce(down, mp_group=group)
    assert col.weight.to_local().shape == (3, 4) and row.weight.to_local().shape == (4, 3)
    x_ref = x.detach().clone().requires_grad_()
    out, ref = row(torch.relu(col(x))), down(torch.relu(up(x_ref)))
    assert torch.allclose(out, ref, atol=1e-6)
    out.square().sum().backward()
    ref.square().sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-5)
    assert torch.allclose(col.weight.grad.full_tensor(), up.weight.grad, atol=1e-5)
    assert torch.allclose(row.bias.grad.full_tensor(), down.bias.grad, atol=1e-5)
    gathered = LinearLayer(up, mp_group=group, gather_output=True)
    assert torch.allclose(gathered(x_ref), up(x_ref), atol=1e-6)
    return True


def test_pipeline_grid_builds_deepspeeds_groups_on_zeros_layout(dist_run):
    assert dist_run(4, _grid_on_four_ranks) == [True] * 4


# ---------------------------------------------------------------------------------------------
# runtime.utils
# ---------------------------------------------------------------------------------------------

def _params_with_grads():
    g = torch.Generator().manual_seed(0)
    params = []
    for shape in ((6,), (3, 4), (5,)):
        p = torch.nn.Parameter(torch.randn(*shape, generator=g))
        p.grad = torch.randn(*shape, generator=g) * 3
        p.grad.view(-1)[0] = 0.0
        params.append(p)
    return params


def test_runtime_utils_norms_partitions_and_helpers():
    params = _params_with_grads()
    grads = torch.cat([p.grad.view(-1) for p in params])
    weights = torch.cat([p.detach().view(-1) for p in params])
    for norm_type in (1, 2, 3, math.inf):
        assert ds_utils.get_flattened_grad_norm(params, norm_type) == pytest.approx(float(grads.norm(norm_type)))
        assert ds_utils.get_weight_norm(params, norm_type) == pytest.approx(float(weights.norm(norm_type)))
        assert float(ds_utils.get_global_norm_of_tensors([p.grad for p in params], norm_type)) == \
            pytest.approx(float(grads.norm(norm_type)), rel=1e-6)
    assert ds_utils.get_grad_norm is ds_utils.get_flattened_grad_norm
    mask = [torch.tensor([[0, 2]]), torch.tensor([]), torch.tensor([[1, 3]])]
    kept = torch.cat([params[0].grad[2:], params[1].grad.view(-1), params[2].grad[[0, 3, 4]]])
    flat = [params[0], torch.nn.Parameter(params[1].detach().view(-1)), params[2]]
    flat[1].grad = params[1].grad.view(-1)
    assert ds_utils.get_flattened_grad_norm(flat, grad_norm_mask=mask) == pytest.approx(float(kept.norm()))
    assert ds_utils.get_grad_zeros(params) == 3.0
    nan = torch.nn.Parameter(torch.zeros(2))
    nan.grad = torch.tensor([1.0, float("nan")])
    assert ds_utils.get_flattened_grad_norm([nan]) == -1
    assert ds_utils.get_global_norm([3.0, 4.0]) == 5.0 and ds_utils.get_global_norm([1.0, -1]) == math.inf
    assert float(ds_utils.combine_grad_norm_groups([3.0, 4.0])) == 5.0
    assert float(ds_utils.combine_grad_norm_groups([torch.tensor(-1.0), 1.0])) == math.inf
    assert bool(ds_utils.has_inf_or_nan(torch.tensor([1.0, math.inf]))) and not ds_utils.has_inf_or_nan(torch.ones(2))

    clipped, reference = _params_with_grads(), _params_with_grads()
    total = ds_utils.clip_grad_norm_(clipped, max_norm=1.0)
    assert float(total) == pytest.approx(float(torch.nn.utils.clip_grad_norm_(reference, 1.0)))
    assert all(torch.allclose(a.grad, b.grad) for a, b in zip(clipped, reference))
    tensors = [torch.full((3,), 4.0)]
    assert float(ds_utils.clip_tensors_by_global_norm(tensors, max_norm=1.0)) == pytest.approx(math.sqrt(48))
    assert torch.allclose(tensors[0], torch.full((3,), 1 / math.sqrt(3)), atol=1e-6)

    # partitioning: DeepSpeed's uniform split; balanced on zero/pipe's partitioner
    assert ds_utils.partition_uniform(10, 4) == [0, 3, 6, 8, 10] and ds_utils.partition_uniform(3, 5) == [0, 1, 2, 3, 3,
                                                                                                           3]
    assert ds_utils.partition_balanced([1, 1, 1, 1, 4], 2) == [0, 4, 5]
    assert ds_utils.partition_balanced([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert ds_utils.partition_balanced([1, 2], 3) == [0, 1, 2, 2] and ds_utils.prefix_sum_inc([3, 4, 5]) == [3, 7, 12]

    # containers, seeds, small helpers
    t = torch.ones(2, dtype=torch.float64)
    moved = ds_utils.move_to_device({"a": [t, (t,)], "b": t}, "cpu", criterion_func=torch.is_tensor)
    assert moved["a"][0] is t and isinstance(moved["a"][1], tuple)
    assert ds_utils.copy_to_device([t, 3], torch.device("meta"), torch.is_tensor)[0].is_meta
    assert ds_utils.get_tensor_bytes({"x": [t, t], "y": (torch.zeros(4, dtype=torch.int8), "s")}) == 36
    ds_utils.set_random_seed(7)
    first = torch.rand(3)
    ds_utils.set_random_seed(7 + 2**64)  # any size of seed, reduced as DeepSpeed does
    assert torch.equal(first, torch.rand(3))
    assert ds_utils.call_to_str("f", 1, "a", x=2) == "f(1, 'a', x=2)" and ds_utils.call_to_str("g") == "g()"
    assert ds_utils.get_only_unique_item([2, 2]) == 2
    with pytest.raises(RuntimeError, match="only one unique"):
        ds_utils.get_only_unique_item([1, 2])
    groups = ds_utils.filter_empty_parameters([{"params": [torch.zeros(0)], "lr": 1},
                                               {"params": [torch.ones(1), torch.zeros(0)], "lr": 2}])
    assert len(groups) == 1 and groups[0]["lr"] == 2 and len(groups[0]["params"]) == 1
    assert ds_utils.DummyOptim(params).param_groups[0]["params"] is params
    assert len(ds_utils.align_dense_tensors([torch.ones(3)], 4)) == 2
    assert ds_utils.noop_decorator(len) is len
    with ds_utils.noop_context():
        pass

    class OldMpu:  # a Megatron mpu of the oldest convention
        def get_model_parallel_rank(self):
            return 3

    assert ds_utils.bwc_tensor_model_parallel_rank(OldMpu()) == 3 and ds_utils.bwc_tensor_model_parallel_rank() == 0
    assert ds_utils.bwc_pipeline_parallel_world_size(OldMpu()) == 1
    with pytest.raises(ValueError, match="no pipeline-parallel group"):
        ds_utils.bwc_pipeline_parallel_group(OldMpu())
    # DeepSpeed's engine internals are explanatory stand-ins
    with pytest.raises(NotAvailableError):
        deepspeed.runtime.utils.CheckOverflow()


def test_runtime_utils_agree_with_deepspeeds():
    theirs = _real_deepspeed("deepspeed.runtime.utils")
    for norm_type in (1, 2, 3, math.inf):
        ours_p, ref_p = _params_with_grads(), _params_with_grads()
        assert ds_utils.get_flattened_grad_norm(ours_p, norm_type) == \
            pytest.approx(theirs.get_flattened_grad_norm(ref_p, norm_type))
        assert ds_utils.get_weight_norm(ours_p, norm_type) == pytest.approx(theirs.get_weight_norm(ref_p, norm_type))
        assert ds_utils.get_grad_zeros(ours_p) == theirs.get_grad_zeros(ref_p)
    for n, parts in [(10, 4), (3, 5), (7, 7), (0, 2), (100, 6)]:
        assert ds_utils.partition_uniform(n, parts) == theirs.partition_uniform(n, parts)
    g = torch.Generator().manual_seed(1)
    for _ in range(50):  # balanced splits: never a heavier heaviest part than DeepSpeed's
        weights = torch.randint(0, 10, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        parts = int(torch.randint(1, len(weights) + 1, (1,), generator=g))
        ours, ref = ds_utils.partition_balanced(weights, parts), [int(b) for b in theirs.partition_balanced(weights,
                                                                                                            parts)]
        heaviest = [max(sum(weights[b[i]:b[i + 1]]) for i in range(parts)) for b in (ours, ref)]
        assert ours[0] == 0 and ours[-1] == len(weights) and heaviest[0] <= heaviest[1]
    pairs = [(ds_utils.call_to_str("f", 1, y=[2]), theirs.call_to_str("f", 1, y=[2])),
             (ds_utils.get_global_norm([1.0, 2.0]), theirs.get_global_norm([1.0, 2.0])),
             (ds_utils.prefix_sum_inc([1, 2, 3]), theirs.prefix_sum_inc([1, 2, 3]))]
    assert all(a == b for a, b in pairs)


# ---------------------------------------------------------------------------------------------
# lr_schedules helpers
# ---------------------------------------------------------------------------------------------

def test_lr_schedule_command_line_helpers_build_scheduler_blocks():
    assert lr_schedules.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert (lr_schedules.WARMUP_MIN_LR, lr_schedules.TOTAL_NUM_STEPS, lr_schedules.CYCLE_MIN_LR,
            lr_schedules.LR_SCHEDULE, lr_schedules.WARMUP_LOG_RATE) == ("warmup_min_lr", "total_num_steps",
                                                                        "cycle_min_lr", "lr_schedule", "log")
    assert lr_schedules.WarmupLR is deepspeed.runtime.lr_schedules.WarmupLR
    parser = lr_schedules.add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--lr_schedule", "WarmupLR", "--warmup_num_steps", "10"])
    config, error = lr_schedules.get_config_from_args(args)
    assert error is None and config == {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 10, "warmup_type": "log"}}
    assert lr_schedules.get_lr_from_config(config) == (0.001, "")
    cosine, _ = lr_schedules.get_config_from_args(parser.parse_args(["--lr_schedule", "WarmupCosineLR"]))
    assert cosine["params"] == {"warmup_num_steps": 1000, "warmup_type": "log", "warmup_min_ratio": 0.01,
                                "cos_min_ratio": 0.01}
    assert lr_schedules.get_lr_from_config(cosine)[0] is None
    cycle, _ = lr_schedules.get_config_from_args(parser.parse_args(["--lr_schedule", "OneCycle"]))
    assert cycle["params"]["cycle_max_lr"] == 0.1 and "cycle_momentum" not in cycle["params"]
    assert lr_schedules.get_lr_from_config(cycle) == (0.1, "")
    range_test, _ = lr_schedules.get_config_from_args(parser.parse_args(["--lr_schedule", "LRRangeTest",
                                                                         "--lr_range_test_staircase"]))
    assert range_test["params"]["lr_range_test_staircase"] is True
    assert lr_schedules.get_lr_from_config(range_test) == (0.001, "")
    assert lr_schedules.get_config_from_args(parser.parse_args([])) == (None, "--lr_schedule not specified on "
                                                                              "command line")
    assert lr_schedules.get_config_from_args(argparse.Namespace(lr_schedule="Nope"))[0] is None
    assert lr_schedules.get_lr_from_config({"params": {}}) == (None, "LR schedule type not defined in config")
    everything: dict = {}
    lr_schedules.override_params(argparse.Namespace(warmup_num_steps=5, cycle_min_lr=None, cos_min_ratio=0.5),
                                 everything)
    assert everything == {"warmup_num_steps": 5, "cos_min_ratio": 0.5}
    # a block made from the command line builds the scheduler, in DeepSpeed's numbers
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = lr_schedules.WarmupLR(opt, **config["params"])
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.0
    group = {"lr": torch.tensor(0.1)}
    assert lr_schedules.update_lr([group], [0.25])[0] is group["lr"] and float(group["lr"]) == 0.25
    assert lr_schedules.get_torch_optimizer(opt) is opt
    with pytest.raises(TypeError, match="not a subclass of torch.optim.Optimizer"):
        lr_schedules.get_torch_optimizer(object())


def test_lr_schedule_helpers_agree_with_deepspeeds():
    theirs = _real_deepspeed("deepspeed.runtime.lr_schedules")
    public = [n for n in dir(theirs) if n.isupper()]
    assert {n: getattr(lr_schedules, n) for n in public} == {n: getattr(theirs, n) for n in public}
    ours_parser = lr_schedules.add_tuning_arguments(argparse.ArgumentParser())
    ref_parser = theirs.add_tuning_arguments(argparse.ArgumentParser())
    assert vars(ours_parser.parse_args([])) == vars(ref_parser.parse_args([]))
    for name in theirs.VALID_LR_SCHEDULES:
        argv = ["--lr_schedule", name, "--warmup_num_steps", "7", "--cycle_max_lr", "0.3"]
        config = lr_schedules.get_config_from_args(ours_parser.parse_args(argv))
        assert config == theirs.get_config_from_args(ref_parser.parse_args(argv))
        assert lr_schedules.get_lr_from_config(config[0]) == theirs.get_lr_from_config(config[0])


# ---------------------------------------------------------------------------------------------
# config_utils, precision_config
# ---------------------------------------------------------------------------------------------

class _Offload(config_utils.DeepSpeedConfigModel):
    device: str = "none"


class _Section(config_utils.DeepSpeedConfigModel):
    size: int = 0
    old_size: str = Field("0", json_schema_extra={"deprecated": True, "new_param": "size", "new_param_fn": int})
    cpu_offload: bool = Field(False, json_schema_extra={"deprecated": True, "new_param": "offload.device",
                                                        "new_param_fn": lambda on: "cpu" if on else "none"})
    legacy: int = Field(0, json_schema_extra={"deprecated": True, "deprecated_msg": "it does nothing"})
    offload: _Offload = Field(default_factory=_Offload)
    dtype: torch.dtype = torch.float16


def test_deepspeed_config_model_handles_deprecated_fields_auto_and_unknown_keys(caplog):
    section = _Section(old_size="5", cpu_offload=True, legacy=3)
    assert (section.size, section.offload.device, section.legacy) == (5, "cpu", 3)
    assert "old_size" not in section.model_dump() and section.model_dump()["dtype"] == "torch.float16"
    assert "old_size is deprecated use size instead" in caplog.text and "legacy is deprecated. it does nothing" in \
        caplog.text
    assert _Section(size="auto").size == 0  # "auto" means the default
    with pytest.raises(Exception, match="size"):
        _Section(strict=True, size="auto")
    with pytest.raises(ValueError, match="give only 'size'"):
        _Section(old_size="5", size=3)
    with pytest.raises(Exception, match="Extra inputs are not permitted"):
        _Section(sizee=1)
    with pytest.raises(Exception, match="valid integer"):
        section.size = "x"  # validated on assignment
    assert config_utils.get_config_default(_Section, "size") == 0
    assert config_utils.get_config_default(_Section, "offload") == _Offload()
    assert repr(config_utils.pp_int(10**5)) == "100,000" and repr(config_utils.pp_int(5, "five")) == "five"
    assert config_utils.pp_int(7) + 1 == 8
    text = json.dumps({"a": 1, "b": {"c": 12345.0, "d": [True, None]}}, cls=config_utils.ScientificNotationEncoder)
    assert text == '{\n    "a": 1,\n    "b": {\n        "c": 1.234500e+04,\n        "d": [true, null]\n    }\n}'
    with pytest.raises(ValueError, match=r"Duplicate keys in DeepSpeed config: \['a'\]"):
        json.loads('{"a": 1, "a": 2}', object_pairs_hook=config_utils.dict_raise_error_on_duplicate_keys)
    assert config_utils.get_scalar_param({"x": 1}, "x", 0) == 1 and config_utils.get_dict_param({}, "x", {}) == {}
    assert config_utils.get_list_param({}, "x", [1]) == [1]


def test_precision_config_models_have_deepspeeds_fields_and_checks():
    fp16 = precision_config.get_float16_config({"fp16": {"enabled": True, "initial_scale_power": 8,
                                                         "loss_scale": "auto"}})
    assert fp16.loss_scale == 0.0 and fp16.initial_dynamic_scale() == 256
    assert fp16.dynamic_loss_scale_args() == {"init_scale": 256, "scale_window": 1000, "delayed_shift": 2,
                                              "consecutive_hysteresis": False, "min_scale": 1}
    assert precision_config.get_float16_config({}).enabled is False
    assert precision_config.get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled is True
    assert precision_config.get_bfloat16_config({"bf16": {}}).check_grad_overflow is True
    for bad, message in [({"loss_scale": True}, "not a boolean"), ({"loss_scale": -1}, ">= 0"),
                         ({"loss_scale": math.inf}, "finite"), ({"min_loss_scale": True}, "not a boolean"),
                         ({"enabled": True, "loss_scale_window": 0}, "loss_scale_window must be > 0"),
                         ({"enabled": True, "min_loss_scale": 0}, "min_loss_scale must be > 0"),
                         ({"bogus": 1}, "Extra inputs")]:
        with pytest.raises(Exception, match=message):
            precision_config.DeepSpeedFP16Config(**bad)
    assert precision_config.DeepSpeedFP16Config(loss_scale=128, loss_scale_window=0).loss_scale_window == 0  # static


def test_precision_and_config_utils_agree_with_deepspeeds():
    theirs = _real_deepspeed("deepspeed.runtime.precision_config")
    for name in ("DeepSpeedFP16Config", "DeepSpeedBF16Config"):
        ours_fields = {k: (f.annotation, f.default) for k, f in getattr(precision_config, name).model_fields.items()}
        ref_fields = {k: (f.annotation, f.default) for k, f in getattr(theirs, name).model_fields.items()}
        assert ours_fields == ref_fields, name
    for name in ("BFLOAT16", "BFLOAT16_OLD", "FP16", "BFLOAT16_FORMAT", "FP16_FORMAT", "INITIAL_LOSS_SCALE",
                 "SCALE_WINDOW", "DELAYED_SHIFT", "CONSECUTIVE_HYSTERESIS", "MIN_LOSS_SCALE"):
        assert getattr(precision_config, name) == getattr(theirs, name), name
    section = {"fp16": {"enabled": True, "loss_scale_window": 10, "hysteresis": 1}}
    assert precision_config.get_float16_config(section).dynamic_loss_scale_args() == \
        theirs.get_float16_config(section).dynamic_loss_scale_args()
    ref_utils = _real_deepspeed("deepspeed.runtime.config_utils")
    assert ref_utils.DeepSpeedConfigModel.model_config == config_utils.DeepSpeedConfigModel.model_config
    assert repr(ref_utils.pp_int(12345)) == repr(config_utils.pp_int(12345))


# ---------------------------------------------------------------------------------------------
# module_inject
# ---------------------------------------------------------------------------------------------

def test_module_inject_has_the_tp_linears_and_explains_the_rest():
    linear = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    for layer in (deepspeed.module_inject.LinearLayer(linear), deepspeed.module_inject.layers.LinearAllreduce(linear,
                                                                                                             None)):
        assert torch.equal(layer(x), linear(x)) and layer.tp_world_size == 1
        assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    with pytest.raises(TypeError, match="slices a Linear"):
        deepspeed.module_inject.LinearLayer(torch.nn.ReLU())
    from zero.deepspeed.module_inject import AutoTP, replace_transformer_layer
    from zero.deepspeed.module_inject.auto_tp import ReplaceWithTensorSlicing
    for absent in (lambda: AutoTP(None, [], "", {}, None, None), lambda: replace_transformer_layer(None, None),
                   lambda: ReplaceWithTensorSlicing()):
        with pytest.raises(NotAvailableError, match="zero.tp.parallelize"):
            absent()
    with pytest.raises(AttributeError):
        deepspeed.module_inject.NoSuchName  # noqa: B018
