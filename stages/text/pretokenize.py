r"""llama.cpp's pre-tokenizers: how a byte-level BPE vocabulary splits text into words before it
merges, named by the file's `tokenizer.ggml.pre`.

A vocabulary was trained on one split; fed another (GPT-2's where DeepSeek-V3 splits digits in
threes and CJK runs apart, say), the model sees token sequences it never saw. llama.cpp's
src/llama-vocab.cpp (llm_tokenizer_bpe) holds each rule as a list of regexes applied in turn, each
splitting every piece the previous ones left (matches and the text between them both kept), then
GPT-2's byte-to-unicode map. The same runs here as `tokenizers` pre-tokenizers: one
Split(Regex, "isolated") per regex, then ByteLevel without its own regex.

The regexes are llama.cpp's own text, with what llama.cpp's engine does to them made explicit:
- it runs a regex with a unicode category over a "collapsed" copy of the text, every non-ASCII
  code point replaced by one byte per category (letter, number, punctuation, mark, symbol), so
  \p{Lu}, \p{Ll}, \p{Lt}, \p{Lm} and \p{Lo} all mean any letter (\p{L}); we write them so;
- std::regex's `$` ends the piece; oniguruma's ends a line, so `$` is written `\z`;
- the rules it runs by hand-written code rather than its regex engine (gpt2, llama3, qwen2, qwen35:
  equal to their regexes, which run here) and kimi-k2, whose code implements Kimi's regex with
  set intersection (`[\p{L}&&[^\p{Han}]]`) and llama.cpp's own list of Han ranges: written here
  as one regex with those ranges (a negative lookahead for the intersection).
Rules llama.cpp implements in ways a Split cannot express (AFMoE's digit groups, SuperBPE's empty
matches, Gemma-4's raw-UTF-8 BPE, Chameleon's image tokens) are not offered: such a `pre` stops
with the names that are (`UnknownPreTokenizer`).
"""
from __future__ import annotations

from dataclasses import dataclass

from moeray.errors import GGUFError

# Each rule's regexes as llama.cpp's llm_tokenizer_bpe lists them (src/llama-vocab.cpp).
_RULES: dict[str, tuple[str, ...]] = {
    "gpt2": (
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    ),
    "default": (
        r"[\p{P}\$\+<=>\^~\|]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"\p{N}+",
        r"[0-9][0-9][0-9]",
    ),
    "llama3": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "jais2": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
    ),
    "deepseek-llm": (
        '[\r\n]',
        r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
        '\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+',
        r"\s+$",
        '[一-龥ࠀ-一가-\ud7ff]+',
        r"\p{N}+",
    ),
    "deepseek-v3": (
        r"\p{N}{1,3}",
        '[一-龥\u3040-ゟ゠-ヿ]+',
        '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+',
    ),
    "spark2_5": (
        r"\p{N}{1,3}",
        '[一-龥\u3040-ゟ゠-ヿ]+',
        '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+',
        r"\p{N}",
    ),
    "youtu": (
        '[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥\u3040-ゟ゠-ヿ]+',
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "deepseek-coder": (
        '[\r\n]',
        r"\s?\p{L}+",
        r"\s?\p{P}+",
        '[一-龥ࠀ-一가-\ud7ff]+',
        r"\p{N}",
    ),
    "falcon": (
        r"[\p{P}\$\+<=>\^~\|`]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"[0-9][0-9][0-9]",
    ),
    "starcoder": (
        r"\p{N}",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    ),
    "qwen2": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "qwen35": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "poro": (
        r" ?[^(\s|.,!?…。，、।۔،)]+",
    ),
    "viking": (
        r" ?[^(\s|.,!?…。，、।۔،)]+",
        r"\p{N}",
    ),
    "tekken": (
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "gpt-4o": (
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "granite-embed-multi": (
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "bailingmoe": (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "seed-coder": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "ufakzeka": (
        r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "laguna": (
        r"[^\n]+|[\n]+",
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "exaone-moe": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "minicpm5": (
        r"\p{N}{1,3}",
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}

# llama.cpp's unicode_cpt_is_han (src/unicode.cpp): CJK unified ideographs, extensions A-F and the
# compatibility ideographs. Not Unicode's \p{Han}, which also holds radicals, 々 and 〇.
_HAN = (r"\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2B73F}\x{2B740}-\x{2B81F}"
        r"\x{2B820}-\x{2CEAF}\x{2CEB0}-\x{2EBEF}\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}")
# llama.cpp's unicode_regex_split_custom_kimi_k2, which its comment derives from Kimi's regex
# (tokenization_kimi.py). Its letter classes test only "a letter, not Han": no case, no marks.
_RULES["kimi-k2"] = (
    rf"[{_HAN}]+|[^\r\n\p{{L}}\p{{N}}]?(?:(?![{_HAN}])\p{{L}})+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)


@dataclass(frozen=True)
class Pre:
    """What a `tokenizer.ggml.pre` name sets in llama.cpp (llama_vocab::impl::load)."""
    rule: str
    ignore_merges: bool = False  # a piece that is a whole token is that token, unmerged (llama3, glm4)
    add_bos: bool = False  # the default when the file has no tokenizer.ggml.add_bos_token
    no_bos: bool = False  # no BOS token unless the file names one (chatglm)


def _names(rule: str, names: str, **kw) -> dict[str, Pre]:
    return {n: Pre(rule, **kw) for n in names.split()}


# llama.cpp's if-chain from `tokenizer.ggml.pre` to a rule, for the rules offered here.
PRE_NAMES: dict[str, Pre] = {
    **_names("default", "default"),
    **_names("llama3", "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
             ignore_merges=True, add_bos=True),
    **_names("deepseek-llm", "deepseek-llm"),
    **_names("deepseek-coder", "deepseek-coder"),
    **_names("deepseek-v3", "deepseek-v3 hunyuan-dense hy_v4 joyai-llm"),
    **_names("spark2_5", "spark2_5"),
    **_names("youtu", "youtu", ignore_merges=True),
    **_names("falcon", "falcon"),
    **_names("gpt2", "mpt gpt-2 phi-2 gigachat a.x-4.0 mellum olmo jais trillion granite-docling exaone4"),
    **_names("jais2", "jais-2"),
    **_names("starcoder", "starcoder refact command-r smollm codeshell exaone minerva-7b mellum2"),
    **_names("qwen2", "qwen2 deepseek-r1-qwen kormo f2llmv2 stablelm2 megrez hunyuan solar-open grok-2"),
    **_names("qwen35", "qwen35"),
    **_names("llama3", "dbrx smaug-bpe"),
    **_names("llama3", "chatglm-bpe", no_bos=True),  # llama.cpp's CHATGLM4 rule is llama3's regex
    **_names("llama3", "glm4 glm5", no_bos=True, ignore_merges=True),
    **_names("poro", "poro-chat bloom gpt3-finnish"),
    **_names("viking", "viking"),
    **_names("tekken", "tekken", ignore_merges=True, add_bos=True),
    **_names("gpt-4o", "gpt-4o llama4 kanana2 talkie minimax-m2"),
    **_names("granite-embed-multi", "granite-embed-multi-97m", ignore_merges=True),
    **_names("bailingmoe", "bailingmoe bailingmoe2 llada-moe"),
    **_names("seed-coder", "seed-coder"),
    **_names("ufakzeka", "ufakzeka"),
    **_names("laguna", "laguna"),
    **_names("exaone-moe", "exaone-moe"),
    **_names("minicpm5", "minicpm5", ignore_merges=True),
    **_names("kimi-k2", "kimi-k2"),
}


class UnknownPreTokenizer(GGUFError):
    pass


def pre_of(name: str | None, source: str = "GGUF") -> tuple[str, Pre]:
    """(the name used, its Pre). No name: llama.cpp's 'default', as llama.cpp does (it warns that
    generation quality degrades; so do we). An unknown name stops, naming the known ones."""
    import logging

    if not name:
        logging.getLogger("moeray").warning(
            "%s: no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer, as llama.cpp does: the text may "
            "split differently from the model's training (re-convert it with a current llama.cpp)", source)
        name = "default"
    pre = PRE_NAMES.get(name)
    if pre is None:
        raise UnknownPreTokenizer(
            f"{source}: unknown pre-tokenizer '{name}' (tokenizer.ggml.pre); moeray splits text as llama.cpp does "
            f"for: {', '.join(sorted(PRE_NAMES))}; re-convert the model with a llama.cpp that names one of them")
    return name, pre


def regexes(rule: str) -> tuple[str, ...]:
    """The rule's regexes as oniguruma (the `tokenizers` library) must read them to split as
    llama.cpp's engine does (see the module's docstring)."""
    out = []
    for r in _RULES[rule]:
        for cat in ("Lu", "Ll", "Lt", "Lm", "Lo"):
            r = r.replace(rf"\p{{{cat}}}", r"\p{L}")
        out.append(r"\s+\z" if r == r"\s+$" else r)  # deepseek-llm's trailing whitespace
    return tuple(out)


def pre_tokenizer(rule: str):
    """The `tokenizers` pre-tokenizer of a rule: its splits, then GPT-2's bytes-to-unicode map."""
    from tokenizers import Regex, pre_tokenizers

    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes(rule)]
    return pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
