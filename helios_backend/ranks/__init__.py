"""RankPeers::Processes (OWN-15): tensor-parallel ranks as processes of their own.

Rank 0's process hosts the scheduler (and the Triton model); every other rank runs
`helios-rank`, which joins rank 0's rendezvous store over TCP, loads its own rank of the
same core and replays each staging frame rank 0 sends it. docs/rank-processes.md has the
design: the rendezvous, the messages, the numpy executor's all-reduce between processes,
failure handling.

    wire.py         framing of the messages on one TCP connection, RankLostError
    rendezvous.py   the store on rank 0, the join of a peer, the identity both must share
    reduce.py       the numpy executor's all-reduce between processes (a star over the links)
    rank_zero.py    ProcessRanksExecutor: the Executor protocol on rank 0, feeding every peer
    rank_process.py the peer's loop: replay what rank 0 sends, answer with completion words
"""
