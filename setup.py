"""omenn_kernels: exact, general and fast OMENN explanations for PyTorch vision models."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="omenn_kernels",
    version="0.1.0",
    description="Exact OMENN explanations (One Matrix to Explain Neural Networks, CVPR 2025) for PyTorch models",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The Triton kernels live in the top-level folder triton_kernels/ and install inside the
    # library's namespace, so that they never shadow (or are shadowed by) another package.
    packages=[*find_packages(include=["omenn_kernels", "omenn_kernels.*"]), "omenn_kernels.triton_kernels"],
    package_dir={"omenn_kernels.triton_kernels": "triton_kernels"},
    package_data={"omenn_kernels.models": ["checkpoints/*.safetensors", "checkpoints/*.json"]},
    install_requires=["torch>=2.6", "torchvision", "timm>=1.0", "numpy", "matplotlib", "ninja", "safetensors",
                      "tqdm", "pillow", "zarr>=3.1"],
    extras_require={
        # the explanation-quality benchmark's compared methods and metrics
        "eval": ["captum", "zennit", "quantus==0.6.0", "scipy"],
        # examples/explain_text.py: Hugging Face models and tokenizers
        "text": ["transformers"],
        "test": ["pytest", "pytest-xdist", "pytest-benchmark", "hypothesis", "captum", "zennit", "quantus==0.6.0", "scipy",
                 "transformers"],  # Hugging Face models and ModelOutput in the tests
    },
    entry_points={"console_scripts": ["omenn=omenn_kernels.cli:entry_point"]},
)
