"""The model zoo (benchmarks/zoo.py): default configs shrunk in size only, and sh.policy() on each at tiny size.

Per entry, one test runs (a) ``sh.policy()`` around plain ``torch.compile``
(inductor) against the compiled step without hooks, and (b) the same eager
against the eager step: both run, (a)'s measured peak is below the compiled
step's, and the worst parameter gradient's SQNR against the reference is at
least :data:`MIN_SQNR_DB`. Another runs (d), (a) under bf16 autocast against the
compiled bf16 step without hooks, to the same bounds. Each costs two inductor
compiles (a minute or two on 2 CPU cores); the entries outside :data:`QUICK`
(:data:`QUICK_BF16` for (d)) are marked ``extended``.
"""

import math

import pytest
import torch

from benchmarks import zoo, zoo_entries

pytest.importorskip("transformers")

# sh.policy()'s goal, which every entry reaches at tiny size, compiled and eager (docs/results/zoo.md has each
# entry's figure; sh.fp8() everywhere measures below it on GQA decoders)
MIN_SQNR_DB = 25.0

# the quick tier runs in every test run, the other entries in the extended one: a decoder, an encoder-decoder
# (whose encoder stands for the encoder family) and a vision model; under bf16 autocast the decoder alone
QUICK = ("llama", "bart", "vit")
QUICK_BF16 = ("llama",)

# config keys an entry may change from its class's default config: sizes, and what the sizes determine
SIZE_KEYS = {
    "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "vocab_size", "n_layer", "n_embd", "n_head", "n_layers", "d_model", "n_heads", "ffn_dim", "word_embed_proj_dim",
    "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_layers", "num_decoder_layers",
    "d_kv", "d_ff", "num_heads", "encoder_layers", "decoder_layers", "encoder_attention_heads",
    "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "image_size", "patch_size", "embed_dim",
    "depths", "window_size", "num_stages", "hidden_sizes", "layer_types", "stage_names", "out_features",
    "out_indices", "max_window_layers", "mlp_only_layers", "pooler_output_size",
}  # fmt: skip
# what an entry sets that is not a size, and why
ALLOWED = {"t5": {"decoder_start_token_id"}}  # shifting the labels needs it; the default T5Config has none


def _params(names, quick=QUICK):
    return [pytest.param(n, marks=[] if n in quick else [pytest.mark.extended]) for n in names]


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_entry_is_its_default_config_with_sizes_shrunk(name):
    entry = zoo.ZOO[name]
    for size in zoo.SIZES:
        config, _ = entry.config(zoo.SIZES[size])
        default = type(config)().to_dict()
        changed = {k for k, v in config.to_dict().items() if default.get(k) != v}
        assert changed <= SIZE_KEYS | ALLOWED.get(name, set()), (size, changed - SIZE_KEYS)
        assert config.to_dict().get("use_cache") == default.get("use_cache")  # as shipped


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_tiny_entry_builds_trains_in_train_mode_and_zeroes_dropout_on_request(name):
    entry = zoo.ZOO[name]
    model, inputs = entry.build("tiny")
    assert model.training
    again, same = entry.build("tiny")
    assert all(torch.equal(inputs[k], same[k]) for k in inputs)  # fixed seed: the same inputs and weights
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    loss = entry.loss_of(model(**inputs))
    assert loss.ndim == 0 and torch.isfinite(loss)
    quiet, _ = entry.build("tiny", dropout=False)
    rates = [v for c in zoo_entries.configs_of(quiet.config) for k, v in vars(c).items() if "drop" in k and isinstance(v, float)]
    assert not any(rates)
    assert all(m.p == 0 for m in quiet.modules() if isinstance(m, torch.nn.Dropout))


def test_table_shows_figures_and_errors():
    ok = zoo.ZooRow("m", "decoder", "-", params_mib=1.0, compiled_mib=2.0, a_ratio=0.5, a_sqnr=math.inf)
    failed = zoo.ZooRow("n", "moe", errors={"a": "RuntimeError: x | y"})
    text = zoo.table([ok, failed])
    assert "| m | decoder | - | 1.00 | 2.00 | 0.50 | exact |" in text
    assert "✗ RuntimeError: x / y" in text  # a pipe inside a cell would split it
    broken = zoo.table([zoo.ZooRow("t", "decoder", e_ratio=0.4, e_sqnr=math.nan)])
    assert "| 0.40 | non-finite |" in broken  # a NaN SQNR: some gradient is not finite, said as such
    page = zoo.document([ok, failed], "python -m benchmarks.zoo", "tiny", 60.0)
    assert "torch " in page and "transformers " in page and "- n / a: `RuntimeError: x | y`" in page


@pytest.mark.slow
def test_jobs_measure_each_entry_in_a_process_of_its_own_and_keep_the_order():
    names = ["llama", "gpt2", "bert"]
    alone = zoo.run(names, only=())
    at_once = zoo.run(names, only=(), jobs=2)
    assert [r.model for r in at_once] == names
    assert [r.params_mib for r in at_once] == [r.params_mib for r in alone]
    assert all(r.params_mib > 0 and not r.errors for r in at_once)


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True])
def test_jobs_below_one_or_not_an_int_are_refused(jobs):
    with pytest.raises(ValueError, match="jobs"):
        zoo.run(["gpt2"], only=(), jobs=jobs)


@pytest.mark.slow
@pytest.mark.parametrize("name", _params(zoo.ZOO))
def test_policy_compiled_and_eager_on_tiny_entry(name):
    row = zoo.measure_model(zoo.ZOO[name], "tiny", only=("a", "b"))
    assert not row.errors, row.errors
    assert row.a_ratio < 1.0, row  # the compiled step's peak, with saved activations packed, is lower
    assert row.a_sqnr >= MIN_SQNR_DB, (row.a_sqnr, row.worst)
    assert row.b_sqnr >= MIN_SQNR_DB, (row.b_sqnr, row.worst)


@pytest.mark.slow
def test_torch_fp8_pass_measured_on_a_tiny_decoder():
    row = zoo.measure_model(zoo.ZOO["llama"], "tiny", only=("e",))
    assert not row.errors, row.errors
    assert row.e_ratio < 1.0, row  # the pass packs saved activations: the compiled step's peak is lower
    assert row.e_sqnr is not None, row  # a figure, or NaN where a gradient is not finite


@pytest.mark.slow
@pytest.mark.parametrize("name", _params(zoo.ZOO, QUICK_BF16))
def test_policy_under_bf16_autocast_on_tiny_entry(name):
    # autocast saves the weights' bf16 copies for the matmuls: the policy keeps them (is_cast_of_input)
    row = zoo.measure_model(zoo.ZOO[name], "tiny", only=("d",))
    assert not row.errors, row.errors
    assert row.d_ratio < 1.0, row
    assert row.d_sqnr >= MIN_SQNR_DB, (row.d_sqnr, row.worst)
