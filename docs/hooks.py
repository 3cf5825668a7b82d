"""MkDocs hooks (named in mkdocs.yml): the benchmark plots join the site from bench/results/,
where the benchmarks write them, so that the pages show the committed files themselves
(their tables are included by pymdownx.snippets the same way)."""

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def on_files(files, config):
    for plot in sorted((ROOT / "bench" / "results").glob("*.png")):
        files.append(File(str(plot.relative_to(ROOT)), src_dir=str(ROOT), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files
