"""Parameter-server mode: a sharded key-value store with sync, async and SSP training.

The last ``servers`` ranks hold the parameters, sharded by bytes (:mod:`.sharding`), and
apply the optimizer on their shards (:mod:`.optim`); the other ranks are workers that push
gradients and pull parameters by key (:mod:`.worker`), with optional compression and
error feedback. Consistency: synchronous (BSP), asynchronous, or stale-synchronous with a
staleness bound (:mod:`.server`). Checkpoints are atomic and ``weights_only``-loadable and
carry per-(worker, key) sequence numbers for exactly-once updates (:mod:`.checkpoint`).

Sources and deviations: bulk-synchronous, asynchronous and stale-synchronous parallel
(SSP after Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel
Parameter Server", NIPS 2013: a worker at clock ``c`` sees every update of clocks
``<= c - s - 1``); push/pull by key and sharded servers after the MXNet KVStore / ps-lite
designs. Ours: the placement rule (split large keys over all servers, the rest to the
least-loaded server), async pushes scaled by ``1/W``, a closed worker no longer holding
SSP back, compression per shard piece with the receiver rebuilding the decompression
context (PowerSGD per worker on the layer's row block covering the piece,
:mod:`.codec`), pull compression as deltas to per-worker copies mirrored on the servers,
checkpoints in key space (one file, any number of servers on restore), and the staleness
statistic (the served worker's clock minus the slowest worker's)::

    kv = mpicomm.ps.KVStore(servers=1, mode="ssp", staleness=2, lr=0.05)
    if kv.is_server:
        kv.serve()
    else:
        kv.init("w", w0)
        for step in range(steps):
            kv.push("w", grad(w))
            w = kv.pull("w")
        kv.close()
"""

from .kvstore import MODES, KVStore

__all__ = ["KVStore", "MODES"]
