// One agent loop through /mcp with the TypeScript MCP SDK's own client, over Streamable HTTP:
// list the tools, claim a task for a role, save a checkpoint, transition the task, then try one
// more tool on the lease that has ended. Prints what it saw as one JSON object on stdout; any
// step that goes wrong exits 1 with the reason on stderr.
//
//   node loop.mjs URL ROLE TRIGGER CHECKPOINT_JSON
//
// The key, when the server wants one, comes from the environment (NULLTICKETS_KEY), never from
// the command line, where other users of the machine could read it.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const LOOP_TOOLS = ["claim_task", "save_checkpoint", "transition_task"];

function fail(message) {
  process.stderr.write(`loop.mjs: ${message}\n`);
  process.exit(1);
}

async function call(client, name, args) {
  const result = await client.callTool({ name, arguments: args });
  if (result.isError) {
    fail(`${name} answered an error: ${JSON.stringify(result.structuredContent ?? result.content)}`);
  }
  return result;
}

async function main() {
  const [url, role, trigger, checkpointText] = process.argv.slice(2);
  if (!url || !role || !trigger || !checkpointText) {
    fail("usage: node loop.mjs URL ROLE TRIGGER CHECKPOINT_JSON");
  }
  const checkpoint = JSON.parse(checkpointText);
  const key = process.env.NULLTICKETS_KEY;
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  const transport = new StreamableHTTPClientTransport(new URL(url), { requestInit: { headers } });
  const client = new Client({ name: "nulltickets-ts-loop", version: "1.0.0" });
  await client.connect(transport);

  const listed = await client.listTools();
  const schemas = Object.fromEntries(listed.tools.map((t) => [t.name, t.inputSchema]));
  for (const name of LOOP_TOOLS) {
    if (!schemas[name]) fail(`the server offers no ${name}`);
    if (schemas[name].type !== "object") fail(`${name}'s input schema is not an object`);
  }

  const claim = await call(client, "claim_task", { role, wait_seconds: 5 });
  const claimed = claim.structuredContent;
  if (!claimed?.claimed) fail(`claim_task got no task: ${JSON.stringify(claimed)}`);

  const saved = await call(client, "save_checkpoint", { checkpoint });
  const moved = await call(client, "transition_task", { trigger });

  // The lease ended with the transition: a tool on it is refused, as a tool result.
  const after = await client.callTool({ name: "heartbeat", arguments: {} });

  const summary = {
    server: client.getServerVersion(),
    tools: listed.tools.map((t) => t.name).sort(),
    schemas: Object.fromEntries(LOOP_TOOLS.map((name) => [name, schemas[name]])),
    claim: claimed,
    claim_text: claim.content.map((c) => c.text ?? "").join("\n"),
    checkpoint: saved.structuredContent,
    transition: moved.structuredContent,
    after_transition: { isError: after.isError === true, structured: after.structuredContent },
  };
  process.stdout.write(`${JSON.stringify(summary)}\n`);
  await client.close();
}

main().catch((err) => fail(err?.stack ?? String(err)));
