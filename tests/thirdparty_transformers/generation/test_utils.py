"""A stand-in for transformers' ``tests/generation/test_utils.py``, which its sdist lacks:
tests/test_thirdparty.py copies this file to ``tests/generation/test_utils.py`` beside the sdist's
``tests/test_modeling_common.py``, which imports ``GenerationTesterMixin`` from it (and whose
``test_generation_tester_mixin_inheritance`` checks that a tester of a model that can generate
inherits it).

Our code, not transformers': ``GenerationTesterMixin`` here holds one test,
``test_generate_compile_model_forward_fullgraph``, written after the test of that name in
transformers 4.57's mixin (what it does, not its text): two batches of inputs of one shape
generate greedily with a dynamic cache, eagerly (``torch.compiler.set_stance("force_eager")``),
then with a static cache, for which ``generate`` compiles the model's forward
(``CompileConfig(fullgraph=True, dynamic=False)``, forced on CPU); the compiled forward must not
recompile for the second batch, and both runs must give the same tokens and scores. Models whose
class says ``_can_compile_fullgraph = False`` (BERT's) skip it, as in transformers.
"""

import torch

from transformers.generation import CompileConfig
from transformers.cache_utils import DynamicCache
from transformers.testing_utils import (CaptureLogger, set_config_for_less_flaky_test, set_model_for_less_flaky_test,
                                       torch_device)
from transformers.utils import logging

# What transformers' GenerationTesterMixin.prepare_config_and_inputs_for_generate leaves out.
INPUTS_NOT_FOR_GENERATE = ("head_mask", "decoder_head_mask", "cross_attn_head_mask", "decoder_input_ids",
                           "decoder_attention_mask", "use_cache", "labels")


class GenerationTesterMixin:
    """Ours (see the module's docstring): the one generation test of this suite."""

    def prepare_config_and_inputs_for_generate(self, batch_size=2):
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        inputs = {key: value[:batch_size] if isinstance(value, torch.Tensor) else value
                  for key, value in inputs_dict.items() if key not in INPUTS_NOT_FOR_GENERATE}
        # No early stop at an end-of-sequence token: every run generates max_new_tokens.
        text_config = config.get_text_config(decoder=True)
        if text_config.eos_token_id is not None and text_config.pad_token_id is None:
            eos = text_config.eos_token_id
            text_config.pad_token_id = eos if isinstance(eos, int) else eos[0]
        text_config.eos_token_id = None
        text_config.forced_eos_token_id = None
        return config, inputs

    def test_generate_compile_model_forward_fullgraph(self):
        for model_class in self.all_generative_model_classes:
            if not model_class._can_compile_fullgraph:
                self.skipTest(f"{model_class.__name__} does not support compilation without graph breaks")
            config, inputs_dict = self.prepare_config_and_inputs_for_generate(batch_size=4)
            set_config_for_less_flaky_test(config)
            model = model_class(config).to(torch_device)
            set_model_for_less_flaky_test(model)
            model.eval()

            # Two sets of different inputs of one shape: the second must reuse the first's compilation.
            half = inputs_dict[model.main_input_name].shape[0] // 2
            input_sets = [{key: value[start:start + half].to(torch_device) if isinstance(value, torch.Tensor) else value
                           for key, value in inputs_dict.items()} for start in (0, half)]

            torch.compiler.reset()
            compile_config = CompileConfig(fullgraph=True, dynamic=False)
            compile_config._compile_all_devices = True  # generate compiles on CUDA only unless told
            kwargs = dict(use_cache=True, do_sample=False, max_new_tokens=5, return_dict_in_generate=True,
                          output_scores=True, compile_config=compile_config)

            eager = []
            with torch.compiler.set_stance("force_eager"):
                for inputs in input_sets:
                    out = model.generate(**inputs, **kwargs)
                    cache = out.past_key_values.self_attention_cache if config.is_encoder_decoder else out.past_key_values
                    self.assertIsInstance(cache, DynamicCache)
                    self.assertFalse(hasattr(model, "_compiled_call"))
                    eager.append(out)

            compiled = []
            try:
                torch._logging.set_logs(recompiles_verbose=True)
                with CaptureLogger(logging.get_logger("torch._dynamo.guards")) as captured:
                    for inputs in input_sets:
                        out = model.generate(**inputs, **kwargs, cache_implementation="static")
                        cache = (out.past_key_values.self_attention_cache if config.is_encoder_decoder
                                 else out.past_key_values)
                        self.assertTrue(cache.is_compileable)
                        self.assertTrue(hasattr(model, "_compiled_call"), "generate did not compile the forward")
                        compiled.append(out)
            finally:
                torch._logging.set_logs()
            if "Recompiling" in captured.out or ("guard" in captured.out and "failure" in captured.out):
                raise RuntimeError(f"torch.compile recompiled {model_class.__name__}'s forward:\n{captured.out}")

            for eager_out, compiled_out in zip(eager, compiled):
                torch.testing.assert_close(compiled_out.sequences, eager_out.sequences)
                for eager_scores, compiled_scores in zip(eager_out.scores, compiled_out.scores):
                    torch.testing.assert_close(compiled_scores, eager_scores, atol=1e-4, rtol=1e-4)

