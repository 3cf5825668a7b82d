"""Three tests of ours beside transformers' ModelTesterMixin, for paths of a model's dropouts that
the mixin's tests run only in eval mode (where a dropout is the identity), only on an
accelerator, or only with the model's default attention:

- ``test_torch_fx_train_mode``: the mixin's ``test_torch_fx*`` trace models in eval mode; this
  traces each class transformers' ``symbolic_trace`` supports in train mode (its dropouts
  active), and the traced module, run from the same ``torch.manual_seed`` as the model, must
  give the model's outputs, loss included, and a loss that backpropagates; with the model's
  default attention and, where that is SDPA, with eager attention too.
- ``test_torch_compile_for_training_cpu``: after the mixin's ``test_torch_compile_for_training``
  (slow, accelerator only): the model's training step (loss, backward) compiled with
  ``fullgraph=True`` (``backend="aot_eager"``: dynamo's and AOTAutograd's graphs, without
  inductor's code generation) runs, and the compiled model in eval mode gives the eager model's
  loss; with the model's default attention and, where that is SDPA, with eager attention too.
- ``test_training_eager_attention``: the mixin's ``test_training`` and its three
  gradient-checkpointing checks (default, ``use_reentrant`` True and False) again with
  ``attn_implementation="eager"``, whose attention dropout is ``dropout(softmax(scores))``
  before ``@ value`` (with ``"sdpa"``, BERT's and GPT-2's default, it is SDPA's ``dropout_p``,
  which ``route_dropout`` leaves to torch on CPU tensors); skipped where the default is eager
  already (T5). The tester's ``attn_implementation`` goes into its configs.

tests/test_thirdparty.py copies this module beside transformers' tests/ with the model test
modules that use it.
"""

import copy
import inspect

import torch

from transformers.models.auto import get_values
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, MODEL_MAPPING_NAMES
from transformers.testing_utils import torch_device
from transformers.utils.fx import _SUPPORTED_MODELS, symbolic_trace


def _tensors(output):
    """The tensors of a model's (nested) tuple output, in order."""
    found = []
    for item in output:
        if isinstance(item, (tuple, list)):
            found += _tensors(item)
        elif isinstance(item, torch.Tensor):
            found.append(item)
    return found


class ExtraDropoutTestsMixin:
    """Ours (see the module's docstring); needs ModelTesterMixin's ``_prepare_for_class``."""

    # The class whose training step test_torch_compile_for_training_cpu compiles.
    compile_train_class = None

    def test_torch_fx_train_mode(self):
        if not self.fx_compatible:
            self.skipTest("not compatible with torch.fx")
        attentions = (None, "eager") if any(cls._supports_sdpa for cls in self.all_model_classes) else (None,)
        for attention in attentions:
            self.model_tester.attn_implementation = attention
            self._check_fx_train_mode(attention or "default")

    def _check_fx_train_mode(self, attention):
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        config.return_dict = False
        config.use_cache = False
        supported = [cls for cls in self.all_model_classes if cls.__name__ in _SUPPORTED_MODELS]
        if not supported:
            self.skipTest("symbolic_trace supports none of the classes")
        for model_class in supported:
            with self.subTest(model_class.__name__, attn_implementation=attention):
                model = model_class(copy.deepcopy(config)).to(torch_device).train()
                if model_class.__name__ in get_values(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES):
                    model.config.problem_type = "single_label_classification"  # as the mixin's test_torch_fx
                labels = model_class.__name__ not in get_values(MODEL_MAPPING_NAMES)
                inputs = self._prepare_for_class(inputs_dict, model_class, return_labels=labels)
                parameters = inspect.signature(model.forward).parameters
                inputs = {key: value for key, value in inputs.items()
                          if isinstance(value, torch.Tensor) and key in parameters}
                traced = symbolic_trace(model, list(inputs))
                torch.manual_seed(0)
                traced_outputs = _tensors(traced(**inputs))
                torch.manual_seed(0)
                model_outputs = _tensors(model(**inputs))
                self.assertEqual(len(traced_outputs), len(model_outputs))
                for index, (traced_output, model_output) in enumerate(zip(traced_outputs, model_outputs)):
                    torch.testing.assert_close(traced_output, model_output,
                                               msg=lambda message: f"output {index}: {message}")
                if labels:
                    traced_outputs[0].backward()
                    self.assertTrue(any(p.grad is not None for p in model.parameters()))

    def test_torch_compile_for_training_cpu(self):
        if self.compile_train_class is None:
            self.skipTest("no compile_train_class")
        attentions = (None, "eager") if self.compile_train_class._supports_sdpa else (None,)
        for attention in attentions:
            with self.subTest(attn_implementation=attention or "default"):
                self.model_tester.attn_implementation = attention
                self._check_compiled_training()

    def _check_compiled_training(self):
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        config.return_dict = True
        config.use_cache = False
        model = self.compile_train_class(config).to(torch_device)
        inputs = self._prepare_for_class(inputs_dict, self.compile_train_class, return_labels=True)
        # Resolved eagerly: its first read logs (once) which loss it picked, which dynamo cannot trace.
        model.loss_function = model.loss_function
        torch.compiler.reset()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")

        model.train()
        loss = compiled(**inputs).loss
        loss.backward()
        self.assertTrue(torch.isfinite(loss))
        missing = [name for name, parameter in model.named_parameters() if parameter.grad is None]
        self.assertLess(len(missing), len(list(model.parameters())), "no parameter got a gradient")

        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(compiled(**inputs).loss, model(**inputs).loss)

    def test_training_eager_attention(self):
        if not any(cls._supports_sdpa for cls in self.all_model_classes):
            self.skipTest("the model's attention is eager already")
        self.model_tester.attn_implementation = "eager"
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        self.assertEqual(config._attn_implementation, "eager")
        self.test_training()
        for kwargs in (None, {"use_reentrant": True}, {"use_reentrant": False}):
            with self.subTest(gradient_checkpointing_kwargs=kwargs):
                self.check_training_gradient_checkpointing(gradient_checkpointing_kwargs=kwargs)
