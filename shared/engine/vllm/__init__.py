"""vLLM's engine under Tandem's seam (`--engine vllm`): vLLM v1's engine core runs in the
node's process and answers `EngineCore` (shared/engine/interface.py). Importing this
package does not import vLLM; `engine.VllmEngine` does, when a node builds one."""
