"""Reference implementations the tests hold fastcore to (issue 24: one home for the test oracles): plain,
obviously correct and slow, written apart from the code under test. ``relay``: leg (1), leg (3) and the
client's answer through json; ``chunk_hashes``: the routers' prefix keys in Python ints."""
