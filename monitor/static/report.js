// The report page's script (monitor/report_page.py): draws each run's verdict, incident
// timeline and plots (uPlot) from the JSON in #report-data; on a live page, refetches it.
(function(){
const COLORS=["#1f77b4","#d62728","#2ca02c","#9467bd","#ff7f0e","#17becf","#8c564b","#e377c2","#7f7f7f","#bcbd22"];
function esc(s){return String(s).replace(/[&<>"']/g,c=>({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;","'":"&#39;"}[c]));}
function fmt(v){if(v===null||v===undefined)return "--";const a=Math.abs(v);return (a!==0&&(a<1e-3||a>=1e5))?v.toExponential(3):(+v.toPrecision(4)).toString();}
// The rules' thresholds as horizontal lines: dashed (red: page, amber: warning) where an
// alert fires, dotted green where it clears, dotted grey for an "and" condition; one
// label per value.
function thresholdPlugin(ths){return {hooks:{draw:[u=>{const ctx=u.ctx,d=devicePixelRatio;ctx.save();ctx.lineWidth=1.5*d;
 const line=(y,color,dash)=>{ctx.strokeStyle=color;ctx.setLineDash(dash);ctx.beginPath();ctx.moveTo(u.bbox.left,y);ctx.lineTo(u.bbox.left+u.bbox.width,y);ctx.stroke();};
 const labels=new Map();const add=(v,text)=>{const k=String(v);labels.set(k,(labels.has(k)?labels.get(k)+"; ":"")+text);};
 for(const t of ths){const y=u.valToPos(t.value,"y",true);if(!isFinite(y))continue;
  line(y,t.condition?"#999":(t.severity==="page"?"#c62828":"#d08700"),t.condition?[2,4]:[8,4]);
  add(t.value,(t.condition?"and: ":"")+t.alert+" "+t.kind+" "+fmt(t.value));
  if(t.clear!==null&&t.clear!==undefined){line(u.valToPos(t.clear,"y",true),"#2e7d32",[2,3]);add(t.clear,t.alert+" clears at "+fmt(t.clear));}}
 ctx.fillStyle="#444";ctx.textAlign="left";ctx.textBaseline="bottom";ctx.font=(10*d)+"px sans-serif";
 for(const [v,text] of labels){const y=u.valToPos(+v,"y",true);if(isFinite(y))ctx.fillText(text,u.bbox.left+4*d,y-2*d);}
 ctx.restore();}]}};}
function timeline(v){const incs=v.incidents;if(!incs.length)return "";const lo=v.first_step??0,hi=Math.max(v.last_step??1,lo+1);
 let h='<div class="timeline" data-role="timeline">';for(const i of incs){const l=100*(i.first_step-lo)/(hi-lo),w=Math.max(0.5,100*(i.last_step-i.first_step)/(hi-lo));
 h+=`<div class="tl-row"><div class="tl-bar ${esc(i.severity)}" style="left:${l}%;width:${w}%" title="${esc(i.alert)} steps ${i.first_step}-${i.last_step}">${esc(i.alert)} ${esc(Object.values(i.labels).join(","))}</div></div>`;}
 return h+`</div><div class="tl-axis"><span>step ${lo}</span><span>step ${hi}</span></div>`;}
function headline(v){const n=v.incidents.length;const steps=v.first_step===null?"no steps":`steps ${v.first_step}-${v.last_step}`;
 if(!n)return [`ok`,`No incident in ${v.reports} reports (${steps}).`];const pages=v.incidents.filter(i=>i.severity==="page").length;
 const cls=pages?"page":(v.incidents.some(i=>i.severity==="warning")?"warning":"info");
 return [cls,`${n} incident(s)${pages?`, ${pages} of severity page`:""} in ${v.reports} reports (${steps}).`];}
function table(v){if(!v.incidents.length)return "";let h='<table class="incidents"><tr><th>alert</th><th>severity</th><th>series</th><th>first step</th><th>last step</th><th>peak</th><th>state</th><th>what to do</th></tr>';
 for(const i of v.incidents){h+=`<tr class="incident" data-alert="${esc(i.alert)}"><td>${esc(i.alert)}</td><td class="sev-${esc(i.severity)}">${esc(i.severity)}</td><td>${esc(Object.entries(i.labels).map(([k,x])=>k+"="+x).join(", ")||"-")}</td><td>${i.first_step}</td><td>${i.last_step}</td><td>${fmt(i.peak)}</td><td>${i.resolved?"resolved":"firing"}</td><td>${esc(i.action)}<div class="note">${esc(i.summary)}</div></td></tr>`;}
 return h+"</table>";}
function coverage(v){const sig=v.signals||{};const names=Object.keys(sig);
 if(names.length)return '<p class="coverage" data-role="coverage">Watched: '+names.map(n=>{const s=sig[n];
  return s.active?`${esc(n)} (active in ${s.active} of ${s.reports} reports)`:`<b>${esc(n)}: ${esc(s.reason)}</b> (${esc(s.detail)})`;}).join("; ")+"</p>";
 const c=v.coverage||{};const groups=["optimizer","loss","params","adam","softmax"];
 return '<p class="coverage" data-role="coverage">Watched: '+groups.map(n=>c[n]?`${n} (${c[n]} of ${v.reports} reports)`:`${n}: no figures`).join("; ")+"</p>";}
function draw(root,data){root.innerHTML="";const width=Math.floor(Math.min(640,Math.max(320,((root.clientWidth||1100)-120)/2)));
 for(const [ri,r] of data.runs.entries()){const v=r.verdict;const [cls,text]=headline(v);const sec=document.createElement("section");sec.className="run";sec.dataset.run=v.run;sec.id="run-"+ri;
  sec.innerHTML=`<h2>Run ${esc(v.run)}</h2><div class="verdict ${cls}" data-role="verdict">${esc(text)}${v.ended?"":" The run has not closed its monitor."}</div>${table(v)}${timeline(v)}${coverage(v)}<div class="plots"></div>`;
  root.appendChild(sec);const plots=sec.querySelector(".plots");
  for(const p of r.panels){const fig=document.createElement("figure");fig.className="plot";fig.dataset.panel=p.key;fig.style.width=(width+14)+"px";
   fig.innerHTML=`<figcaption>${esc(p.title)}${p.left_out?` <span class="note">(${p.left_out} more series not drawn: the most extreme are shown)</span>`:""}</figcaption>`;plots.appendChild(fig);
   const series=[{label:"step"}].concat(p.series.map((s,i)=>({label:s.label,stroke:COLORS[i%COLORS.length],width:s.incident?2.5:1.2,spanGaps:true,points:{show:false},value:(u,x)=>fmt(x)})));
   const ys=p.thresholds.map(t=>t.value);const opts={width:width,height:240,series:series,plugins:[thresholdPlugin(p.thresholds)],
    scales:{x:{time:false},y:{range:(u,mn,mx)=>{let a=Math.min(mn,...ys),b=Math.max(mx,...ys);if(!isFinite(a)||!isFinite(b)){a=0;b=1;}const pad=(b-a)*0.08||1;return [a-pad,b+pad];}}},
    axes:[{label:"step"},{size:60,values:(u,vals)=>vals.map(fmt)}],legend:{live:true}};
   new uPlot(opts,[p.x].concat(p.series.map(s=>s.values)),fig);}}}
window.trainvitalsDraw=draw;
const root=document.getElementById("runs");const data=JSON.parse(document.getElementById("report-data").textContent);draw(root,data);
const live=document.body.dataset.live;if(live){let last=data.generated;setInterval(()=>{fetch(live,{cache:"no-store",credentials:"same-origin"}).then(r=>r.ok?r.json():null).then(d=>{if(d){draw(root,d);last=d.generated;document.getElementById("updated").textContent="updated "+new Date(d.generated*1000).toLocaleTimeString();}}).catch(()=>{});},2000);}
})();
