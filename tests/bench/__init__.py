"""The benchmarks' command lines and the results page, without timing anything."""
