"""Lookup drafts under a grammar (actors/speculation/structured.py `GrammarState.extend`, drafters.LookupDrafter): a
proposal is cut where the grammar refuses it and continued by the tokens the grammar forces, the matcher left as it
was, and an n-gram engine drafting so under tool grammars still emits plain constrained greedy decoding's tokens."""

from __future__ import annotations

from types import SimpleNamespace

from actors.engine.offline import generate
from actors.speculation.drafters import NgramDrafter
from actors.speculation.step import Drafting
from actors.speculation.structured import GrammarCompiler
from cluster.config import SpeculationConfig
from cluster.request import SamplingParams
from deploy.serve.tool_parsers import HermesParser
from deploy.serve.tools import grammar, plan
from tests.fixtures.agent_model import AGENT_TOKENS, HERMES_TEMPLATE
from tests.fixtures.tiny_models import build_tokenizer
from tests.unit.helpers import load, text_prompts
from tests.unit.test_structured import make_engine
from tests.unit.test_tool_calls import FUNCTION_SCHEMAS, tool, tool_specs

SKELETON = '<tool_call>\n{"name": "f", "arguments": {"v": {"a": '


def test_the_grammar_forces_a_calls_skeleton_and_cuts_a_refused_lookup(tmp_path) -> None:
    """`required` with one tool: the call's opening is the only continuation the grammar allows, so it is drafted
    from nothing; a lookup that strays is cut at its first refused token and the forced tokens follow the rest."""
    tokenizer = build_tokenizer(tmp_path, HERMES_TEMPLATE, AGENT_TOKENS)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    spec = grammar(plan([tool("f", FUNCTION_SCHEMAS[0])], "required", False), HermesParser(),
                   tokenizer.get_added_vocab())
    state = compiler.matcher(spec)
    forced = state.extend([], 64)
    text = tokenizer.decode(forced)
    assert forced and SKELETON.startswith(text) and len(text) > len("<tool_call>\n{")  # past the first token
    assert state.extend([], 64) == forced and state.valid_prefix(forced) == len(forced)  # the state was left as is
    assert state.extend([], 2) == forced[:2]  # k bounds it
    head = tokenizer.encode('<tool_call>\n{"', add_special_tokens=False)
    stray = tokenizer.encode("xyz", add_special_tokens=False)
    drafted = state.extend(head + stray, 64)
    assert drafted[:len(head)] == head and tokenizer.decode(drafted) == text  # cut at "xyz", then forced again
    state.consume(tokenizer.encode(SKELETON, add_special_tokens=False))  # inside the integer: nothing is forced
    assert state.extend([], 8) == []


def test_an_ngram_drafter_without_a_match_drafts_what_the_grammar_forces(tmp_path) -> None:
    """Tokens that never repeat give the n-gram lookup nothing; under the `required` grammar the drafter still
    proposes the call's forced opening, in `lookahead` (what the policy sees) and in `propose`."""
    tokenizer = build_tokenizer(tmp_path, HERMES_TEMPLATE, AGENT_TOKENS)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    spec = grammar(plan([tool("f", FUNCTION_SCHEMAS[0])], "required", False), HermesParser(),
                   tokenizer.get_added_vocab())
    drafter = NgramDrafter(SpeculationConfig(method="ngram"))
    plain = SimpleNamespace(request_id="a", token_ids=[5, 6, 7, 8], grammar=None)
    assert drafter.lookahead(plain, 4) == 0
    state = compiler.matcher(spec)
    seq = SimpleNamespace(request_id="b", token_ids=[5, 6, 7, 8], grammar=state)
    forced = state.extend([], 4)
    assert len(forced) == 4 and drafter.lookahead(seq, 4) == 4
    work = SimpleNamespace(seq=seq, start=3, num_new=1, emits=True)
    assert drafter.propose([Drafting(work, 4)]).proposals["b"].tokens == forced


def test_ngram_drafts_under_tool_grammars_equal_plain_constrained_decoding(tiny_models, tiny_draft_models) -> None:
    """The 20 tool grammars of test_tool_calls (required, named, some parallel), n-gram drafting with the grammar's
    forced tokens against plain decoding: the same tokens, and drafts were proposed and accepted."""
    prompt = text_prompts(load(tiny_models["llama"]), 1, offset=3)[0]
    specs = tool_specs()
    params = [SamplingParams(temperature=0.0, max_tokens=64, structured=s) for s in specs]
    got = generate(make_engine(tiny_models, tiny_draft_models, "ngram"), [prompt] * len(specs), params)
    want = generate(make_engine(tiny_models, tiny_draft_models, "none"), [prompt] * len(specs), params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert sum(c.stats.accepted for c in got) > 0
