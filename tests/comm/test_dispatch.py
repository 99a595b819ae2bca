"""The dispatch table is the one source of which algorithm serves which operation where."""

import pytest

from meshtrain.comm.algorithms import REGISTRY, TABLE, algorithms_for, implementation, shm_direct
from meshtrain.comm.transport import registry


@pytest.mark.parametrize("kind", registry.names())
def test_algorithms_for_lists_exactly_the_table_entries_the_transport_offers(kind):
    caps = registry.capabilities_of(kind)
    for op in REGISTRY:
        names = algorithms_for(op, kind)
        assert names == [n for (o, n), impl in TABLE.items() if o == op and impl.offered_on(caps)]
        assert all(callable(implementation(op, n)) for n in names)
        assert names[: len(REGISTRY[op])] == list(REGISTRY[op])  # meshtrain's own: everywhere, first
        assert ("native" in names) == caps.native_collectives
        assert ("shm" in names) == (caps.shared_memory and op in shm_direct.ALGORITHMS)


def test_every_table_entry_belongs_to_a_known_operation():
    assert {op for op, _ in TABLE} == set(REGISTRY)
    assert {n for (_, n), impl in TABLE.items() if impl.needs == "native_collectives"} == {"native"}
    assert {n for (_, n), impl in TABLE.items() if impl.needs == "shared_memory"} == {"shm"}
