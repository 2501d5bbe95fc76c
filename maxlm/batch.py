"""The batch a train step takes, declared once. Each field is a name with its per-row shape, dtype and
logical axes (the batch's first). The data source declares the fields it yields (packed token rows:
maxlm.data.order.fields) and the objective names those it reads (objectives); StateSpec lays the batch
out from the fields, the loader assembles each field it yields by them, microbatches split each by its own
axes (schedules.split), and data/order.py builds rows by them. So a new field, a float per sequence or an
image, needs no change outside the code that declares it. Imports no jax: the data workers build rows by
it."""

from typing import Any, Callable, NamedTuple

import numpy as np


class Field(NamedTuple):
    name: str
    shape: tuple[int, ...]      # one row's (the batch axis comes first, and is not named here)
    dtype: str                  # numpy's name for it
    axes: tuple                 # logical axes of the whole array: "batch" and then one per dimension of `shape`

    def zeros(self) -> np.ndarray:
        """One row of zeros."""
        return np.zeros(self.shape, self.dtype)


class Schema(NamedTuple):
    fields: tuple[Field, ...]
    rows: int                             # the global batch's
    metrics: Callable | None = None       # metrics(batch) -> what the step reports of the batch itself

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def axes(self) -> dict:
        return {f.name: f.axes for f in self.fields}

    def abstract(self, mesh, rule_table) -> dict[str, Any]:
        """Each field as a jax.ShapeDtypeStruct of the global batch, sharded by its logical axes."""
        import jax

        from maxlm import sharding

        return {f.name: jax.ShapeDtypeStruct((self.rows, *f.shape), np.dtype(f.dtype),
                                             sharding=sharding.named(mesh, f.axes, rule_table)) for f in self.fields}

    def check(self, needs: tuple[str, ...], who: str) -> None:
        """Refuse, in one line, a reader (an objective) that needs fields this batch does not have."""
        missing = [n for n in needs if n not in self.names]
        if missing:
            from maxlm.errors import ConfigError
            raise ConfigError(f"{who} reads the batch fields {', '.join(missing)}, which this data does not have "
                              f"(it has {', '.join(self.names)})")
