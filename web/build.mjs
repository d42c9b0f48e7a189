// Builds the page into one directory: index.html, app.js (src/main.ts and its libraries,
// bundled and minified by esbuild) and app.css. `node build.mjs [OUT_DIR]` (default dist/).
// build.rs runs it for the `cyrene` binary, which embeds the result (docs/web.md).
import { build } from "esbuild";
import { copyFileSync, mkdirSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = resolve(process.argv[2] ?? join(here, "dist"));
mkdirSync(out, { recursive: true });
await build({
  entryPoints: [join(here, "src/main.ts")],
  outfile: join(out, "app.js"),
  bundle: true,
  format: "esm",
  target: "es2022",
  minify: true,
  legalComments: "eof",
  logLevel: "warning",
});
copyFileSync(join(here, "index.html"), join(out, "index.html"));
copyFileSync(join(here, "src/app.css"), join(out, "app.css"));
