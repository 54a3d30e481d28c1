"""The test harness, also used by the demo and the benchmarks (not shipped in the wheel): tiny
checkpoint builders, test images, the server process, the HTTP client and the transformers
reference. Everything is made on the spot: no download needed."""
