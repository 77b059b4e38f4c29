"""Strings a pre-tokenizer must split as llama.cpp does: digits, CJK, punctuation, code and
whitespace, plus other scripts and marks. Used against llama.cpp's own tokenizer (llama-cpp-python,
vocab_only) on a shipped vocabulary with each `tokenizer.ggml.pre` written in
(tests/stages/test_tokenizer_llama_cpp.py, tests/make_pretok_reference.py)."""
from __future__ import annotations

STRINGS = [
    # digits: runs of every length, with separators, other number forms
    "1", "12", "123", "1234", "12345", "123456", "1234567", "3.14159", "1,000,000", "2024-06-01", "v1.2.3",
    "0x1F3A", "1e-9", "+44 20 7946 0958", "½ ¾ ² ³ ⅓", "٣٤٥ ١٢", "１２３４５", "Ⅻ ⅷ", "9a9b9c", "x=10000000000",
    # CJK and other scripts
    "我想在apple工作1314151天～", "こんにちは世界", "カタカナとひらがな", "안녕하세요 세계", "〇々〆ヶ", "漢字かな交じり文",
    "中文，标点。测试！", "㐀㐁 𠀀𠀁 豈更", "⺀⺁⼀", "Привет, мир!", "Ελληνικά κείμενα", "مرحبا بالعالم", "שלום עולם",
    "नमस्ते दुनिया", "สวัสดีชาวโลก", "Tiếng Việt có dấu", "Xin chào thế giới", "ქართული", "Հայերեն",
    # letters, case and marks
    "HelloWORLDfooBar", "ÀÉÎÕÜ àéîõü", "e\u0301 a\u0308 n\u0303", "ǅemal ǈ", "İstanbul ıi", "straße STRASSE",
    "ﬁ ﬂ ﬀ", "ＡＢＣ ａｂｃ！", "µ Ω K Å", "ℂℍℕ ℓ", "Dž ǲ",
    # case changes inside a word (gpt-4o splits them, llama3 does not), iteration marks beside Han
    # (Kimi's Han is llama.cpp's list of ranges, not Unicode's script: 々 is a letter there)
    "iPhone", "JavaScript on YouTube", "GitHub iOS LaTeX", "人々", "時々 佐々木",
    # contractions and quotes
    "I'm you're we've they'll he'd it's", "I'M YOU'RE WE'VE THEY'LL", "'s 'S 'RE 'Ve", "don't stop", "‘quoted’ “double”",
    # punctuation and symbols
    "Hello, world!", "...!?;:", "a--b—c–d", "(parens) [brackets] {braces}", "#hash @at $dollar %pct ^caret &amp",
    "<html><body>x</body></html>", "a+b=c; x*y/z", "→ ⇒ ∀ ∃ ∑ ∫", "€100 £50 ¥1000", "©®™", "🦙.cpp 🚀 (normal) 😶‍🌫️ ✅",
    "👍🏽👨‍👩‍👧", "《书名》「引用」【注】", "ok!!!!!", "http://example.com/a?b=c&d=e",
    # code
    "def f(x):\n    return x**2  # square\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "if x:\n\n\n    pass", "SELECT * FROM t WHERE id=42;", "console.log(`${a}+${b}`)", "x_1 = foo_bar(BAZ_2)",
    "    Hello\n    Hello", "#include <stdio.h>\nint main(){}", "a\\nb\\tc", "'''docstring'''",
    # whitespace
    " ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n", "\t\n", " \n \n", "\r\n", "a\r\nb", "Hello world", " Hello world",
    "  Hello", "   Hello", "Hello  ", "a  b   c    d", "\u00a0nbsp\u00a0", "ideographic\u3000space", "tab\tsep\tvalues",
    "trailing\n", "\n leading newline", "a \n b", "x\u2028y\u2029z", "\u200bzero\u200dwidth",
    # mixed
    "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～", "w048 7tuijk dsdfhu", "нещо на Български",
    "កាន់តែពិសេសអាចខលចេញ", "3333333333", "333 3333 33333", "ab12cd345ef6789", "A1B2C3", "The year 1999's best",
    # special tokens written in text (read as text with parse_special=False, whole with True)
    "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>x", "<s>a</s>", "<think>reasoning</think>answer",
]
