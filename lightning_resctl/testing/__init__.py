"""Small models shared by the benchmarks (and usable by tests); not part of the training API."""
