"""jaxpipe: asynchronous pipeline-parallel LLM pretraining in JAX.

Subpackages, each importable on its own:
  jaxpipe.optim     optax transforms: Muon, SOAP, MARS, NorMuon, AdamW, Lion,
                    Adan, gradient delay, the error-feedback correction, weight
                    prediction, and `build` from a config.
  jaxpipe.model     a Llama-style decoder with stacked blocks.
  jaxpipe.data      tokenised corpora on disk and a grain input pipeline.
  jaxpipe.pipeline  schedules (none, gpipe, 1f1b, 2bw, pipedream, interleaved) on a mesh.
"""

__version__ = "0.1.0"
