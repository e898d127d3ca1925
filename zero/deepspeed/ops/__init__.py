"""`deepspeed.ops`: the optimizers scripts import by name, and `__compatible_ops__`."""
from zero.deepspeed._missing import missing
from zero.deepspeed.ops import adam, op_builder  # noqa: F401


def _compatible_ops() -> dict[str, bool]:
    """DeepSpeed's op name -> whether zero can run that op here (what its builder's is_compatible() says)."""
    return {name: getattr(op_builder, cls)().is_compatible() for cls, (name, _) in op_builder.BUILDERS.items()}


def __getattr__(name: str):
    if name == "__compatible_ops__":  # probed at first use (it may ask a compiler), then one dict, as in DeepSpeed
        globals()[name] = _compatible_ops()
        return globals()[name]
    return missing(__name__, name)
