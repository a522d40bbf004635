"""The README, the docs' examples and tutorials, and PyTorch's example programs, run as written."""
