"""qlbench: synthetic benchmarks and theorem checks for parameter-efficient fine-tuning."""

__version__ = "0.1.0"
