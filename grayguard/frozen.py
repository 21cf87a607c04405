"""Cheap construction and copies of frozen dataclasses built for every node or series every tick.

`evolve` is dataclasses.replace for the controller's memories; `dict_init` gives a frozen dataclass an __init__
that stores its fields at once. Both keep the dataclass's behaviour (equality, repr, hash, replace, pickling,
FrozenInstanceError) and refuse classes whose __init__ does more than store its fields.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

T = TypeVar("T")


def evolve(obj: T, **changes) -> T:
    """dataclasses.replace(obj, **changes) for the controller's memories (SignalMemory, LiveMemory, NodeState) at a
    fraction of its cost (replace walks the fields in Python and runs a frozen __init__, one object.__setattr__ a
    field; every tick copies each node's memories). The same object: a frozen dataclass's __init__ does nothing but
    store each field in the instance's __dict__ (evolve takes only classes without __post_init__ or __slots__, whose
    every field is an __init__ argument), so the copy is that __dict__, in the same order, with the changes over it.
    The price: a copy holds its fields in a dict object (about 64 bytes more than __init__'s inline values, and one
    more object for the garbage collector). An unknown field raises TypeError, as with replace."""
    return replaced(obj, changes)


def replaced(obj: T, changes: dict) -> T:
    """evolve(obj, **changes) with the changes in a dict the caller built (the decision core gathers a node's
    changes of a tick in one): no keyword arguments to merge and unpack, half the cost of a call with ten."""
    cls = type(obj)
    names = _FIELDS.get(cls) or _FIELDS.setdefault(cls, _fields_of(cls))
    state = obj.__dict__.copy()
    state.update(changes)
    if len(state) != len(names):  # a name that is no field added an entry
        raise TypeError(f"{cls.__name__} has no field {sorted(changes.keys() - names)[0]!r}")
    new = _new(cls)
    _set(new, "__dict__", state)  # a frozen class refuses only setattr of its fields
    return new


_new, _set = object.__new__, object.__setattr__


def _fields_of(cls: type) -> frozenset[str]:
    """The names of the fields of a class evolve can copy by its __dict__ (TypeError for any other)."""
    fields = dataclasses.fields(cls)
    if any(not f.init for f in fields) or hasattr(cls, "__post_init__") or "__slots__" in vars(cls):
        raise TypeError(f"evolve needs every field of {cls.__name__} to be an __init__ argument, stored by __init__ "
                        "alone in the instance's __dict__")
    return frozenset(f.name for f in fields)


_FIELDS: dict[type, frozenset[str]] = {}  # per class, made at its first copy


def dict_init(cls: type[T]) -> type[T]:
    """Give a frozen dataclass (applied above @dataclass) an __init__ that sets the instance's __dict__ to a dict of
    its arguments, in one call: the __init__ dataclass writes for a frozen class calls object.__setattr__ once per
    field, several times the cost for the classes built for every node or series every tick (NodeInput,
    NodeDecision). A new dict, not item writes into self.__dict__: those make a dict that shares
    its keys with the class (a split dict), whose attributes CPython 3.11 reads on its slow path, three times
    slower; the decision core reads a NodeInput's fields some fifty times a tick. The price: a dict of its own
    (NodeInput's 29 fields: about 540 bytes more while a tick holds it; NodeDecision's 5: about 110 bytes less
    than the split dict).
    The same signature (every field, in order, positional or keyword, each default the same object), the same
    instance (evolve's conditions: nothing else happens in a dataclass __init__), still frozen afterwards. Generated
    from the fields, as dataclass generates its own, so that a new field cannot be forgotten."""
    fields = dataclasses.fields(cls)
    _fields_of(cls)  # every field an __init__ argument stored in __dict__ alone (TypeError otherwise)
    if any(f.default_factory is not dataclasses.MISSING or f.kw_only or f.name in ("self", "_set") for f in fields):
        raise TypeError(f"dict_init takes no default_factory, kw_only field or field named self or _set "
                        f"({cls.__name__})")
    defaults = {f"_default_{f.name}": f.default for f in fields if f.default is not dataclasses.MISSING}
    params = ", ".join(f.name if f.default is dataclasses.MISSING else f"{f.name}=_default_{f.name}" for f in fields)
    fields_dict = ", ".join(f"{f.name!r}: {f.name}" for f in fields)
    made: dict = {}
    exec(f"def __init__(self, {params}):\n    _set(self, '__dict__', {{{fields_dict}}})\n",
         {**defaults, "_set": object.__setattr__}, made)
    init = made["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__annotations__ = dict(cls.__init__.__annotations__)  # type: ignore[misc]
    cls.__init__ = init  # type: ignore[misc]
    return cls
