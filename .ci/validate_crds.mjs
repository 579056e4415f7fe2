// Validates custom resources (a JSON array on stdin) against the schemas of their CRDs, as
// published in the npm packages @kubernetes-models/keda and @kubernetes-models/prometheus-operator
// (validators generated from the KEDA and prometheus-operator API types). They check types,
// required fields and enums; unlike kubernetes-validate --strict they do not reject unknown fields.
// Usage: node validate_crds.mjs TOOLS_DIR < crds.json   (TOOLS_DIR from .ci/deploy_tools.sh)
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const modules = join(process.argv[2] ?? "/work/tools", "node", "node_modules", "@kubernetes-models");
const load = async (path) => import(pathToFileURL(join(modules, path)).href);
const models = {
  "keda.sh/v1alpha1/ScaledObject": (await load("keda/keda.sh/v1alpha1/ScaledObject.js")).ScaledObject,
  "monitoring.coreos.com/v1/ServiceMonitor":
    (await load("prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor.js")).ServiceMonitor,
};

let failed = 0;
for (const doc of JSON.parse(readFileSync(0, "utf8"))) {
  const key = `${doc.apiVersion}/${doc.kind}`;
  const Model = models[key];
  const name = `${doc.kind.toLowerCase()}/${doc.metadata?.name}`;
  if (!Model) {
    console.log(`ERROR ${name}: no schema for ${key}`);
    failed++;
    continue;
  }
  try {
    new Model(doc).validate();
    console.log(`  ${name} valid against the ${doc.apiVersion} ${doc.kind} schema`);
  } catch (e) {
    console.log(`ERROR ${name}: ${e.message}`);
    failed++;
  }
}
process.exit(failed ? 1 : 0);
