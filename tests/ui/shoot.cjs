// Open one Prefect UI page in headless Chromium, wait until it shows `expect`, save a screenshot
// of the whole page and print what a user sees as JSON: {url, text, images: [{src, width}]}.
//
//     NODE_PATH=.venv/node/node_modules node tests/ui/shoot.cjs URL OUT.png [EXPECT] [TIMEOUT_S]
//
// Only 127.0.0.1 and localhost resolve, so nothing leaves the machine.
const { chromium } = require("playwright-core");

const [url, out, expect = "", timeoutS = "90"] = process.argv.slice(2);
const executablePath = process.env.CHROMIUM || "/usr/bin/chromium";

function pageText() {
  return document.body ? document.body.innerText : "";
}

// The UI scrolls an inner container: the content height is the tallest scrollable element.
function contentHeight() {
  let h = document.documentElement.scrollHeight;
  for (const el of document.querySelectorAll("*")) h = Math.max(h, el.scrollHeight);
  return Math.min(h, 8000);
}

(async () => {
  const browser = await chromium.launch({
    executablePath,
    headless: true,
    args: ["--no-sandbox", "--disable-gpu",
           "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost"],
  });
  try {
    const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
    await page.goto(url, { waitUntil: "networkidle", timeout: Number(timeoutS) * 1000 });
    // A single-page app keeps fetching after networkidle: poll the text until it shows `expect`.
    const deadline = Date.now() + Number(timeoutS) * 1000;
    let text = await page.evaluate(pageText);
    while (expect && !text.includes(expect) && Date.now() < deadline) {
      await page.waitForTimeout(1000);
      text = await page.evaluate(pageText);
    }
    await page.waitForTimeout(2000);
    text = await page.evaluate(pageText);
    await page.setViewportSize({ width: 1400, height: await page.evaluate(contentHeight) });
    await page.waitForTimeout(500);
    await page.screenshot({ path: out, fullPage: true });
    const images = await page.evaluate(() =>
      Array.from(document.images, (i) => ({ src: i.src.slice(0, 40), width: i.naturalWidth })));
    process.stdout.write(JSON.stringify({ url: page.url(), text, images }));
  } finally {
    await browser.close();
  }
})().catch((err) => {
  process.stderr.write(String(err && err.stack ? err.stack : err) + "\n");
  process.exit(1);
});
