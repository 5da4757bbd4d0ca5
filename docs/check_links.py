#!/usr/bin/env python3
"""Checks README.md and docs/*.md: every relative Markdown link resolves to an existing file (and a
#anchor to a heading of that file), and every repository path written in the text exists.
Run from anywhere: python3 docs/check_links.py [REPO_ROOT]. Exit status 1 if anything is missing."""
import os, re, sys, glob
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) if len(sys.argv) < 2 else sys.argv[1]
files = [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))
def slug(h):
    h = h.strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")
def anchors(path):
    out = set()
    in_code = False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out
bad = 0
tops = ("src/", "include/", "tests/", "tools/", "examples/", "bench/", "scripts/", "docs/", "cmake/")
for f in files:
    rel = os.path.relpath(f, root)
    text = open(f, encoding="utf-8").read()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    for m in re.finditer(r"\]\(([^)\s]+)\)", prose):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue
        path, _, frag = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
        if not os.path.exists(dest):
            print(f"{rel}: broken link {target}"); bad += 1
        elif frag and dest.endswith(".md") and frag not in anchors(dest):
            print(f"{rel}: no heading '#{frag}' in {os.path.relpath(dest, root)}"); bad += 1
    # Paths written as text: tokens starting with a top-level folder.
    for m in re.finditer(r"(?<![\w./-])((?:%s)[\w./{},*-]*)" % "|".join(re.escape(t) for t in tops), text):
        p = m.group(1).rstrip(".,:;")
        if "*" in p or text[m.end():m.end() + 1] == "<":
            continue
        # expand {a,b} once
        mm = re.search(r"\{([^}]*)\}", p)
        cands = [p[:mm.start()] + x + p[mm.end():] for x in mm.group(1).split(",")] if mm else [p]
        for c in cands:
            if not os.path.exists(os.path.join(root, c)):
                print(f"{rel}: missing path {c}"); bad += 1
print(f"{len(files)} files checked, {bad} problem(s)")
sys.exit(1 if bad else 0)
